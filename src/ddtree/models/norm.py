"""RMSNorm, with the residual add that precedes it in a decoder layer.

Two paths compute it: the PyTorch reference (the CPU default, autograd, and the specification)
and the Triton kernel of fused_norm.py (the CUDA default when no gradient is needed), one launch
instead of about eight elementwise and reduction kernels. Both round at the same points.
"""

from __future__ import annotations

import torch
from torch import nn

from ..kernels import use_kernel
from .fused_moe import ExpertRows, expert_sum
from .fused_norm import DTYPES, rms_norm


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., D] -> weight * normalize(x): statistics in float32, the normalized x rounded to
    x.dtype before the weight multiplies it (transformers' DeepseekV3RMSNorm)."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


class RMSNorm(nn.Module):
    """`fused` picks the path: None (automatic: the kernel on CUDA without autograd), True (the
    kernel; on the CPU under TRITON_INTERPRET=1, for tests) or False (PyTorch). Set it on the
    class to switch every norm, or on one instance; models.switches.set_kernel_paths sets every
    switched module of a model."""

    fused: bool | None = None

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, delta: torch.Tensor | ExpertRows | None = None):
        """x [..., dim] -> RMSNorm(x) [..., dim]; with delta (x's shape, or the MoE's unsummed
        ExpertRows), the residual add first: returns (x + delta, RMSNorm(x + delta))."""
        if isinstance(delta, ExpertRows):  # the kernel sums the rows itself; PyTorch wants the sum
            if self._use_kernel(x, None) and delta.dtype == x.dtype:
                return rms_norm(x, self.weight, self.eps, delta)
            delta = expert_sum(delta, x)
        if self._use_kernel(x, delta):
            return rms_norm(x, self.weight, self.eps, delta)
        if delta is None:
            return rms_norm_reference(x, self.weight, self.eps)
        x = x + delta
        return x, rms_norm_reference(x, self.weight, self.eps)

    def _use_kernel(self, x: torch.Tensor, delta: torch.Tensor | None) -> bool:
        tensors = (x, self.weight) if delta is None else (x, self.weight, delta)
        if not use_kernel(self.fused, "RMSNorm.fused", *tensors):
            return False
        # The automatic choice leaves other dtypes (float64 checks) on PyTorch; a forced one errs.
        if self.fused is not None:
            return True
        return x.dtype in DTYPES and self.weight.dtype in DTYPES and (
            delta is None or (delta.dtype == x.dtype and delta.shape == x.shape))
