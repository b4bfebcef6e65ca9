"""Per-head RMSNorm then rotate-half rope (Qwen3's q_norm / k_norm and rotary embedding, as the
DFlash drafter applies them): the reference and one Triton kernel for the queries and keys of a
pass together.

    qk_norm_rope_reference  PyTorch: rms_norm_reference per head, then the rotation op by op
    _norm_rope_kernel       one program per (token, block of heads)

Heads [0, split) take the first weight and heads [split, H) the second, so the joint output of
the q and k projections (adjacent columns of one GEMM) takes one launch. Both paths round at the
same points (the norm's two, then each product, difference and sum of the rotation to x's
dtype); they differ in the order of the norm's sum (and the interpreter truncates to bf16 where
torch rounds).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import DTYPES, launch_flags, require_kernel_device, wait_for_producers
from .norm import rms_norm_reference

HEADS_PER_PROGRAM = 4


def qk_norm_rope_reference(x: torch.Tensor, weights: tuple[torch.Tensor, torch.Tensor], split: int,
                        cos: torch.Tensor, sin: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., T, H, d]; weights ([d], [d]) for heads [0, split) and [split, H); cos, sin
    [..., T, d / 2] in x's dtype. Returns [..., T, H, d] in x's dtype."""
    normed = torch.cat([rms_norm_reference(x[..., :split, :], weights[0], eps),
                        rms_norm_reference(x[..., split:, :], weights[1], eps)], dim=-2)
    cos, sin = cos[..., None, :], sin[..., None, :]
    x1, x2 = normed.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


@triton.jit
def _round(x, DTYPE: tl.constexpr):
    return x.to(DTYPE).to(tl.float32)


@triton.jit
def _norm_rope_kernel(
    x_ptr, w0_ptr, w1_ptr, cos_ptr, sin_ptr, out_ptr,
    heads, split, eps,
    stride_xt, stride_xh, stride_ct, stride_ot, stride_oh,
    HALF: tl.constexpr, BLOCK_H: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_producers(PDL)
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    c = tl.arange(0, HALF)
    ok = (h < heads)[:, None]
    at = x_ptr + t * stride_xt + h[:, None] * stride_xh + c[None, :]
    dtype = x_ptr.dtype.element_ty
    x1 = tl.load(at, mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(at + HALF, mask=ok, other=0.0).to(tl.float32)
    scale = tl.rsqrt((tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)) / (2 * HALF) + eps)[:, None]
    first = (h < split)[:, None]
    w1 = tl.where(first, tl.load(w0_ptr + c)[None, :], tl.load(w1_ptr + c)[None, :]).to(tl.float32)
    w2 = tl.where(first, tl.load(w0_ptr + HALF + c)[None, :], tl.load(w1_ptr + HALF + c)[None, :]).to(tl.float32)
    n1 = _round(_round(x1 * scale, dtype) * w1, dtype)  # rms_norm_reference's two roundings
    n2 = _round(_round(x2 * scale, dtype) * w2, dtype)
    cos = tl.load(cos_ptr + t * stride_ct + c).to(tl.float32)[None, :]
    sin = tl.load(sin_ptr + t * stride_ct + c).to(tl.float32)[None, :]
    y1 = _round(n1 * cos, dtype) - _round(n2 * sin, dtype)
    y2 = _round(n2 * cos, dtype) + _round(n1 * sin, dtype)
    to = out_ptr + t * stride_ot + h[:, None] * stride_oh + c[None, :]
    tl.store(to, y1.to(dtype), mask=ok)
    tl.store(to + HALF, y2.to(dtype), mask=ok)


def qk_norm_rope(x: torch.Tensor, weights: tuple[torch.Tensor, torch.Tensor], split: int, cos: torch.Tensor,
              sin: torch.Tensor, eps: float, *, out: torch.Tensor | None = None, pdl: bool = True) -> torch.Tensor:
    """qk_norm_rope_reference in one launch.

    x:       [..., T, H, d], bf16 / fp16 / fp32, unit stride over d; tokens and heads may be strided
             (a slice of the q / k / v projections' joint output).
    weights: ([d], [d]) in x's dtype, for heads [0, split) and [split, H).
    cos, sin: [..., T, d / 2] in x's dtype (models.layers.rotary_cos_sin).
    out:     optional, x's shape and dtype, unit stride over d; may be x itself (each program
             reads its heads before it writes them).
    Returns out (default a new contiguous tensor).
    """
    d = x.shape[-1]
    if x.dtype not in DTYPES or x.dim() < 3 or d % 2 or x.stride(-1) != 1:
        raise ValueError(f"x must be [..., T, H, d] (even d, unit stride over d) in {DTYPES}, "
                         f"got {x.dtype} {list(x.shape)} strides {x.stride()}")
    if not 0 <= split <= x.shape[-2]:
        raise ValueError(f"split must be in [0, H={x.shape[-2]}], got {split}")
    for name, w in (("weights[0]", weights[0]), ("weights[1]", weights[1])):
        if w.shape != (d,) or w.dtype != x.dtype or w.device != x.device:
            raise ValueError(f"{name} must be [{d}] {x.dtype} on {x.device}, got {w.dtype} {list(w.shape)} on {w.device}")
    want = (*x.shape[:-2], d // 2)
    for name, t in (("cos", cos), ("sin", sin)):
        if t.shape != want or t.dtype != x.dtype or t.device != x.device:
            raise ValueError(f"{name} must be {list(want)} {x.dtype}, got {t.dtype} {list(t.shape)} on {t.device}")
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device) if out is None else out
    if out.shape != x.shape or out.dtype != x.dtype or out.device != x.device or out.stride(-1) != 1:
        raise ValueError(f"out must be x's shape, dtype and device with unit stride over d, got {out.dtype} "
                         f"{list(out.shape)} on {out.device}")
    heads = x.shape[-2]
    tokens = x.reshape(-1, heads, d)  # a copy only where the tokens do not flatten: read-only
    try:
        to = out.view(-1, heads, d)
    except RuntimeError as error:
        raise ValueError(f"out's tokens must flatten without a copy, got strides {out.stride()}") from error
    cos2, sin2 = cos.reshape(-1, d // 2).contiguous(), sin.reshape(-1, d // 2).contiguous()
    require_kernel_device(x.device, "qk_norm_rope")
    if tokens.shape[0] and heads:
        grid = (tokens.shape[0], triton.cdiv(heads, HEADS_PER_PROGRAM))
        _norm_rope_kernel[grid](
            tokens, weights[0].contiguous(), weights[1].contiguous(), cos2, sin2, to,
            heads, split, eps,
            tokens.stride(0), tokens.stride(1), cos2.stride(0), to.stride(0), to.stride(1),
            HALF=d // 2, BLOCK_H=HEADS_PER_PROGRAM, num_warps=1, **launch_flags(x.device, pdl),
        )
    return out

