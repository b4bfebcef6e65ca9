"""RMSNorm, optionally with the residual add before it: the reference and one Triton kernel.

    rms_norm_reference  PyTorch, the specification (transformers' DeepseekV3RMSNorm)
    _rms_norm_kernel    one program per row: [s = x + delta, stored;] y = w * (s * rsqrt(mean(s^2) + eps))

Both round at the same points: the sum to x's dtype, the statistics in float32, the normalized
row to x's dtype, then the product with the weight to the promoted dtype of x and weight. The
grid is the row count: CUDA-graph capturable.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import DTYPES, launch_flags, require_kernel_device, wait_for_producers

MAX_COLS = 65536  # one row lives in one program's registers


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., D] -> weight * normalize(x): statistics in float32, the normalized x rounded to
    x.dtype before the weight multiplies it."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


@triton.jit
def _rms_norm_kernel(
    x_ptr, delta_ptr, w_ptr, out_ptr, sum_ptr,
    cols, eps,
    stride_xr, stride_dr, stride_or, stride_sr,
    HAS_DELTA: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_producers(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    ok = offs < cols
    x = tl.load(x_ptr + row * stride_xr + offs, mask=ok, other=0.0)
    if HAS_DELTA:
        delta = tl.load(delta_ptr + row * stride_dr + offs, mask=ok, other=0.0)
        x = (x.to(tl.float32) + delta.to(tl.float32)).to(x_ptr.dtype.element_ty)  # x + delta in x's dtype
        tl.store(sum_ptr + row * stride_sr + offs, x, mask=ok)
    x32 = x.to(tl.float32)
    mean_sq = tl.sum(x32 * x32, axis=0) / cols  # masked columns load 0: they add nothing
    normed = (x32 * tl.rsqrt(mean_sq + eps)).to(x_ptr.dtype.element_ty)
    w = tl.load(w_ptr + offs, mask=ok, other=0.0)
    y = normed.to(tl.float32) * w.to(tl.float32)
    tl.store(out_ptr + row * stride_or + offs, y.to(out_ptr.dtype.element_ty), mask=ok)


def _rows(t: torch.Tensor, name: str, cols: int) -> torch.Tensor:
    """t [..., cols] as [rows, cols] with unit column stride (a view when the strides allow)."""
    if t.shape[-1] != cols:
        raise ValueError(f"{name} must end in the weight's size {cols}, got shape {list(t.shape)}")
    if t.dtype not in DTYPES:
        raise TypeError(f"{name} must be one of {DTYPES}, got {t.dtype}")
    t = t.reshape(-1, cols)
    return t if t.stride(-1) == 1 or t.shape[0] == 0 else t.contiguous()


def _buffer(buf: torch.Tensor | None, name: str, shape, dtype: torch.dtype, device) -> torch.Tensor:
    if buf is None:
        return torch.empty(shape, dtype=dtype, device=device)
    if buf.shape != shape or buf.dtype != dtype or buf.device != device or not buf.is_contiguous():
        raise ValueError(f"{name} must be a contiguous {dtype} {list(shape)} on {device}, "
                         f"got {buf.dtype} {list(buf.shape)} on {buf.device}")
    return buf


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, delta: torch.Tensor | None = None, *,
             out: torch.Tensor | None = None, sum_out: torch.Tensor | None = None, pdl: bool = True
             ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm of x, or of x + delta, in one kernel launch.

    x:      [..., D], bf16 / fp16 / fp32; any strides (rows are read through their stride; a
            layout that does not flatten to rows is copied first).
    weight: [D], bf16 / fp16 / fp32, on x's device.
    delta:  optional, x's shape and dtype: the residual branch added to x first.
    out, sum_out: optional contiguous buffers for y and (with delta) s, e.g. a graph's static ones.
    pdl:    launch with programmatic dependent launch where the GPU has it (ops/launch.py).
    Returns y [..., D] in promote_types(x.dtype, weight.dtype), contiguous; with delta the pair
    (s, y) where s = x + delta [..., D] in x.dtype and y = RMSNorm(s).
    """
    if weight.dim() != 1:
        raise ValueError(f"weight must be [D], got shape {list(weight.shape)}")
    if weight.dtype not in DTYPES:
        raise TypeError(f"weight must be one of {DTYPES}, got {weight.dtype}")
    cols = weight.shape[0]
    if cols > MAX_COLS:
        raise ValueError(f"weight has {cols} elements: at most {MAX_COLS} (one row per program)")
    for name, t in (("weight", weight), ("delta", delta)):
        if t is not None and t.device != x.device:
            raise ValueError(f"{name} is on {t.device} but x is on {x.device}")
    if delta is not None and (delta.shape != x.shape or delta.dtype != x.dtype):
        raise ValueError(f"delta must match x ({x.dtype} {list(x.shape)}), got {delta.dtype} {list(delta.shape)}")
    require_kernel_device(x.device, "rms_norm")
    x2 = _rows(x, "x", cols)
    out = _buffer(out, "out", x.shape, torch.promote_types(x.dtype, weight.dtype), x.device)
    total = _buffer(sum_out, "sum_out", x.shape, x.dtype, x.device) if delta is not None else out
    d2 = _rows(delta, "delta", cols) if delta is not None else x2
    if x2.shape[0]:
        block = triton.next_power_of_2(cols)
        _rms_norm_kernel[(x2.shape[0],)](
            x2, d2, weight.contiguous(), out, total,
            cols, eps,
            x2.stride(0), d2.stride(0), cols, cols,
            HAS_DELTA=delta is not None, BLOCK=block, num_warps=min(16, max(1, block // 512)),
            **launch_flags(x.device, pdl),
        )
    return (total, out) if delta is not None else out
