"""One switch for every kernel-or-PyTorch choice inside a model (norms, MLA, router, routed experts)."""

from __future__ import annotations

from torch import nn

from .moe import MoE, Router
from .norm import RMSNorm
from .target import MLA

SWITCHED = (RMSNorm, MLA, Router, MoE)
KERNEL_PATHS = {"auto": None, "kernels": True, "reference": False}


def set_kernel_paths(model: nn.Module, choice: str) -> int:
    """Set `fused` on every switched module of `model` (a Target or a Drafter): "auto" (the Triton
    kernels on CUDA without autograd, the default), "kernels" (forced) or "reference" (the PyTorch
    paths, as the tests' references). Returns how many modules were set."""
    if choice not in KERNEL_PATHS:
        raise ValueError(f"kernel paths must be one of {sorted(KERNEL_PATHS)}, got {choice!r}")
    switched = [m for m in model.modules() if isinstance(m, SWITCHED)]
    for module in switched:
        module.fused = KERNEL_PATHS[choice]
    return len(switched)
