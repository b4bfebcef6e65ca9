"""One decision, made once: which path each op of a model takes.

A KernelPolicy is chosen when a model is built or loaded (`load_target`, `load_drafter`,
`random_target`; the benchmarks' `--kernels`) and every layer that has a Triton kernel beside its
PyTorch reference (RMSNorm, MLA, the router, the MoE) holds it. No layer reads a switch or a size
limit from a module global; `apply_policy` hands a model a new one.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import nn

from .gemm import MAX_ROWS
from .launch import DTYPES
from .moe_align import MAX_PAIRS

PATHS = ("auto", "kernels", "reference")
AUTO_DEVICES = ("cuda", "cpu")


@dataclass(frozen=True)
class KernelPolicy:
    """paths: "auto" (the Triton kernels on tensors of auto_devices when autograd needs nothing
    from the call, within the limits below; PyTorch elsewhere), "kernels" (the kernels wherever
    asked: on the CPU under TRITON_INTERPRET=1; an error when autograd would need a backward) or
    "reference" (PyTorch everywhere: the specification the kernels are tested against).
    auto_devices: the device types on which "auto" takes the kernels: CUDA; ("cuda", "cpu") lets
    tests check the automatic choices and limits on the CPU, where the kernels run interpreted.
    pdl: launch the kernels with programmatic dependent launch where the GPU has it (ops/launch.py).
    gemm_max_rows: at most this many rows run the few-row GEMM (ops/gemm.py, at most its MAX_ROWS);
    more go to cuBLAS, whose tiles fill the GPU. 0: never.
    moe_fused_max_tokens: "auto" runs the fused MoE (ops/moe.py) for at most this many tokens and
    the grouped GEMMs above (the crossing: benchmarks/results/moe_paths-crossing-nvidia-h100.md,
    written by the script; moe_paths-nvidia-h200.md, transcribed from printed rows).
    moe_direct_max_tokens: up to this many tokens the fused MoE skips its alignment (one program
    per (token, choice) pair: one token's choices are distinct experts). 0: never."""

    paths: str = "auto"
    pdl: bool = True
    gemm_max_rows: int = MAX_ROWS
    moe_fused_max_tokens: int = 544
    moe_direct_max_tokens: int = 1
    auto_devices: tuple[str, ...] = ("cuda",)

    def __post_init__(self):
        if self.paths not in PATHS:
            raise ValueError(f"kernel paths must be one of {PATHS}, got {self.paths!r}")
        if not isinstance(self.auto_devices, tuple) or not set(self.auto_devices) <= set(AUTO_DEVICES):
            raise ValueError(f"auto_devices must be a tuple of {AUTO_DEVICES}, got {self.auto_devices!r}")
        if not 0 <= self.gemm_max_rows <= MAX_ROWS:
            raise ValueError(f"gemm_max_rows must be in [0, {MAX_ROWS}], got {self.gemm_max_rows}")
        if not 0 <= self.moe_fused_max_tokens or not 0 <= self.moe_direct_max_tokens:
            raise ValueError(f"the MoE's token limits must be >= 0, got {self.moe_fused_max_tokens} and "
                             f"{self.moe_direct_max_tokens}")

    @property
    def automatic(self) -> bool:
        return self.paths == "auto"

    def kernel(self, what: str, *tensors: torch.Tensor) -> bool:
        """Whether the op `what` takes its Triton path for these tensors (the first decides the
        device): "auto" on auto_devices (CUDA) when autograd needs nothing from this call,
        "kernels" always, "reference" never."""
        needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
        if self.paths == "auto":
            return tensors[0].device.type in self.auto_devices and not needs_grad
        if self.paths == "kernels" and needs_grad:
            raise RuntimeError(f"{what}: the kernel policy forces kernels, but autograd needs this forward "
                               "and the kernel has no backward")
        return self.paths == "kernels"

    def moe_fused(self, tokens: int, pairs: int, dtype: torch.dtype, *tensors: torch.Tensor, int4: bool = False) -> bool:
        """Whether a MoE forward of `tokens` rows and `pairs` (token, choice) pairs in `dtype` runs
        the fused kernels (ops/moe.py) rather than the grouped GEMMs. INT4 experts take them at any
        size ("auto": on auto_devices; the layer feeds them in chunks), since their grouped reference
        dequantizes every chosen expert."""
        chosen = self.kernel("MoE", *tensors)
        if self.automatic:
            fits = int4 or (tokens <= self.moe_fused_max_tokens and pairs <= MAX_PAIRS)
            return chosen and fits and dtype in DTYPES
        return chosen

    def but(self, **changes) -> "KernelPolicy":
        """A copy with some fields changed (dev/ and benchmarks/ compare variants this way)."""
        return replace(self, **changes)


REFERENCE = KernelPolicy("reference")
KERNELS = KernelPolicy("kernels")


def apply_policy(model: nn.Module, policy: KernelPolicy) -> int:
    """Hand `policy` to every layer of `model` that holds one; returns how many."""
    if not isinstance(policy, KernelPolicy):
        raise TypeError(f"policy must be a KernelPolicy, got {type(policy).__name__}")
    holders = [m for m in model.modules() if hasattr(m, "policy") and isinstance(m.policy, KernelPolicy)]
    for module in holders:
        module.policy = policy
    return len(holders)
