"""The DFlash drafter's projected queries, keys and values to where attention reads them, in one
launch per layer: Qwen3's per-head q_norm / k_norm, rotate-half rope on queries and keys, the keys
and values written into the drafter's context cache. The reference and one Triton kernel.

    drafter_qkv_reference  PyTorch: rms_norm_reference per head, the rotation op by op, the cache
                           writes by index (what the drafter ran before this kernel)
    _drafter_qkv_kernel    one program per (token, block of heads)

Both round at the same points (the norm's two, then each product, difference and sum of the
rotation, to the projection's dtype); they differ in the order of the norm's sum (and the
interpreter truncates to bf16 where torch rounds).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import DTYPES, launch_flags, require_kernel_device, wait_for_producers
from .norm import rms_norm_reference

HEADS_PER_PROGRAM = 4


def drafter_qkv_reference(qkv: torch.Tensor, q_heads: int, weights: tuple[torch.Tensor, torch.Tensor],
                          cos: torch.Tensor, sin: torch.Tensor, eps: float, k_cache: torch.Tensor,
                          v_cache: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor) -> torch.Tensor | None:
    """drafter_qkv's specification (its docstring): returns the rotated queries, or None without
    any; writes the caches."""
    kv_heads = (qkv.shape[-2] - q_heads) // 2
    cos, sin = cos[..., None, :], sin[..., None, :]

    def rotated(x, weight):
        x1, x2 = rms_norm_reference(x, weight, eps).chunk(2, dim=-1)
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)

    k = rotated(qkv[..., q_heads : q_heads + kv_heads, :], weights[1])
    k_cache[rows, slots] = k.to(k_cache.dtype)
    v_cache[rows, slots] = qkv[..., q_heads + kv_heads :, :].to(v_cache.dtype)
    return rotated(qkv[..., :q_heads, :], weights[0]) if q_heads else None


@triton.jit
def _round(x, DTYPE: tl.constexpr):
    return x.to(DTYPE).to(tl.float32)


@triton.jit
def _drafter_qkv_kernel(
    x_ptr, wq_ptr, wk_ptr, cos_ptr, sin_ptr, q_ptr, k_cache_ptr, v_cache_ptr, rows_ptr, slots_ptr,
    q_heads, kv_heads, capacity, eps,
    stride_xt, stride_xh, stride_ct, stride_qt, stride_qh, stride_cb, stride_cs, stride_ch,
    HALF: tl.constexpr, BLOCK_H: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_producers(PDL)
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)  # [queries | keys | values]
    c = tl.arange(0, HALF)
    is_q = (h < q_heads)[:, None]
    is_v = (h >= q_heads + kv_heads)[:, None]
    ok = (h < q_heads + 2 * kv_heads)[:, None]
    at = x_ptr + t * stride_xt + h[:, None] * stride_xh + c[None, :]
    dtype = x_ptr.dtype.element_ty
    x1 = tl.load(at, mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(at + HALF, mask=ok, other=0.0).to(tl.float32)
    scale = tl.rsqrt((tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)) / (2 * HALF) + eps)[:, None]
    w1 = tl.where(is_q, tl.load(wq_ptr + c)[None, :], tl.load(wk_ptr + c)[None, :]).to(tl.float32)
    w2 = tl.where(is_q, tl.load(wq_ptr + HALF + c)[None, :], tl.load(wk_ptr + HALF + c)[None, :]).to(tl.float32)
    n1 = _round(_round(x1 * scale, dtype) * w1, dtype)  # rms_norm_reference's two roundings
    n2 = _round(_round(x2 * scale, dtype) * w2, dtype)
    cos = tl.load(cos_ptr + t * stride_ct + c).to(tl.float32)[None, :]
    sin = tl.load(sin_ptr + t * stride_ct + c).to(tl.float32)[None, :]
    # rounded to the projection's dtype before any wider cache takes them; values pass as they are
    y1 = tl.where(is_v, x1, _round(_round(n1 * cos, dtype) - _round(n2 * sin, dtype), dtype))
    y2 = tl.where(is_v, x2, _round(_round(n2 * cos, dtype) + _round(n1 * sin, dtype), dtype))
    to_q = q_ptr + t * stride_qt + h[:, None] * stride_qh + c[None, :]
    tl.store(to_q, y1.to(q_ptr.dtype.element_ty), mask=ok & is_q)
    tl.store(to_q + HALF, y2.to(q_ptr.dtype.element_ty), mask=ok & is_q)
    slot = tl.load(slots_ptr + t)
    # A slot outside the capacity is never written (another request's entries follow there). The
    # engine sizes the capacity so that none is (engine/loading.drafter_capacity); eager callers
    # can have append_context(check=True) refuse one; the reference's indexing raises
    entry = tl.load(rows_ptr + t) * stride_cb + slot * stride_cs
    in_cache = ok & (slot >= 0) & (slot < capacity)
    is_k = ~is_q & ~is_v
    to_k = k_cache_ptr + entry + (h - q_heads)[:, None] * stride_ch + c[None, :]
    tl.store(to_k, y1.to(k_cache_ptr.dtype.element_ty), mask=in_cache & is_k)
    tl.store(to_k + HALF, y2.to(k_cache_ptr.dtype.element_ty), mask=in_cache & is_k)
    to_v = v_cache_ptr + entry + (h - q_heads - kv_heads)[:, None] * stride_ch + c[None, :]
    tl.store(to_v, y1.to(v_cache_ptr.dtype.element_ty), mask=in_cache & is_v)
    tl.store(to_v + HALF, y2.to(v_cache_ptr.dtype.element_ty), mask=in_cache & is_v)

def drafter_qkv(qkv: torch.Tensor, q_heads: int, weights: tuple[torch.Tensor, torch.Tensor], cos: torch.Tensor,
                sin: torch.Tensor, eps: float, k_cache: torch.Tensor, v_cache: torch.Tensor, rows: torch.Tensor,
                slots: torch.Tensor, *, pdl: bool = True) -> torch.Tensor | None:
    """drafter_qkv_reference in one launch.

    qkv:     [B, S, q_heads + 2 kv_heads, d], bf16 / fp16 / fp32, unit stride over d (the q, k and v
             projections' joint output; q_heads may be 0: keys and values only).
    weights: (q_norm, k_norm) weights [d] each, in qkv's dtype.
    cos, sin: [B, S, d / 2] in qkv's dtype (models.layers.rotary_cos_sin at the tokens' positions).
    k_cache, v_cache: [R, capacity, kv_heads, d], one dtype of DTYPES, unit stride over d: token
             (b, s) goes to row rows[b, s], slot slots[b, s] (int64 [B, S]); a slot outside
             [0, capacity) is not written (the reference raises on it).
    Returns the rotated queries [B, S, q_heads, d] in qkv's dtype (None when q_heads is 0).
    """
    b, s, heads, d = qkv.shape
    kv_heads = (heads - q_heads) // 2
    if qkv.dtype not in DTYPES or d % 2 or qkv.stride(-1) != 1 or heads - q_heads != 2 * kv_heads or kv_heads < 1:
        raise ValueError(f"qkv must be [B, S, q_heads + 2 kv_heads, d] (even d, unit stride over d) in {DTYPES}, "
                         f"got {qkv.dtype} {list(qkv.shape)} with q_heads={q_heads}")
    for name, w in (("weights[0]", weights[0]), ("weights[1]", weights[1])):
        if w.shape != (d,) or w.dtype != qkv.dtype or w.device != qkv.device:
            raise ValueError(f"{name} must be [{d}] {qkv.dtype} on {qkv.device}, got {w.dtype} {list(w.shape)} on {w.device}")
    for name, t in (("cos", cos), ("sin", sin)):
        if t.shape != (b, s, d // 2) or t.dtype != qkv.dtype or t.device != qkv.device:
            raise ValueError(f"{name} must be [{b}, {s}, {d // 2}] {qkv.dtype}, got {t.dtype} {list(t.shape)} on {t.device}")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if (t.dim() != 4 or t.shape[2:] != (kv_heads, d) or t.stride() != k_cache.stride() or t.dtype != k_cache.dtype
                or t.dtype not in DTYPES or t.device != qkv.device or t.stride(-1) != 1):
            raise ValueError(f"{name} must be [R, capacity, {kv_heads}, {d}] like k_cache, in {DTYPES}, on {qkv.device}, "
                             f"unit stride over d, got {t.dtype} {list(t.shape)} strides {t.stride()}")
    for name, t in (("rows", rows), ("slots", slots)):
        if t.shape != (b, s) or t.dtype != torch.int64 or t.device != qkv.device:
            raise ValueError(f"{name} must be int64 [{b}, {s}] on {qkv.device}, got {t.dtype} {list(t.shape)}")
    require_kernel_device(qkv.device, "drafter_qkv")
    q = torch.empty(b, s, q_heads, d, dtype=qkv.dtype, device=qkv.device)
    tokens = qkv.reshape(b * s, heads, d)  # a copy only where the tokens do not flatten: read-only
    cos2, sin2 = cos.reshape(b * s, d // 2).contiguous(), sin.reshape(b * s, d // 2).contiguous()
    if b * s:
        grid = (b * s, triton.cdiv(heads, HEADS_PER_PROGRAM))
        _drafter_qkv_kernel[grid](
            tokens, weights[0].contiguous(), weights[1].contiguous(), cos2, sin2, q if q_heads else tokens, k_cache, v_cache,
            rows.contiguous(), slots.contiguous(), q_heads, kv_heads, k_cache.shape[1], eps,
            tokens.stride(0), tokens.stride(1), cos2.stride(0), max(1, q_heads) * d, d,
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            HALF=d // 2, BLOCK_H=HEADS_PER_PROGRAM, num_warps=1, **launch_flags(qkv.device, pdl),
        )
    return q if q_heads else None
