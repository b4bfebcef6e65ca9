"""MLA's small per-row steps as Triton kernels, for the paged (verify / decode) forward.

    _rotary_kernel        out[t, h] = rotate(x[t, h]) by cos[t], sin[t]: the query's rotary part,
                          written straight into its slot of the attention query (no torch.cat)
    _latent_entry_kernel  cache[slot[t]] = [RMSNorm(latent[t]), rotate(k_rope[t])]: norm, rotary,
                          concatenation, cast and cache write of one token's entry in one launch

Rounding follows the PyTorch path (MLA.rotated, rope.rotate): the rotary products and their sum
are each rounded to the activation dtype, the norm as in fused_norm.py. Grids depend on the
shapes only: CUDA-graph capturable.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..kernels import require_kernel_device
from ..pdl import launch_flags, wait_for_producers

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# Warps of the cache-entry kernel: absorbed_query's launch (skinny.NUM_WARPS) writes the same entries
# with 2, and the latent norm's sum is only bit-equal between the two at the same warp count (the
# reduction order follows the layout; a float32 test caught 1-ulp differences at 4 against 2).
ENTRY_WARPS = 2


@triton.jit
def _rotate(x_ptr, cos_ptr, sin_ptr, out_ptr, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, INTERLEAVE: tl.constexpr):
    """out[:HALF] = x1 cos - x2 sin, out[HALF:] = x2 cos + x1 sin; pairs (x1, x2) interleaved
    (evens, odds) or halves. Each product and sum rounded to x's dtype, as torch does."""
    offs = tl.arange(0, BLOCK_HALF)
    ok = offs < HALF
    if INTERLEAVE:
        x1 = tl.load(x_ptr + 2 * offs, mask=ok, other=0.0)
        x2 = tl.load(x_ptr + 2 * offs + 1, mask=ok, other=0.0)
    else:
        x1 = tl.load(x_ptr + offs, mask=ok, other=0.0)
        x2 = tl.load(x_ptr + HALF + offs, mask=ok, other=0.0)
    cos = tl.load(cos_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    dt = x1.dtype
    x1, x2 = x1.to(tl.float32), x2.to(tl.float32)  # 16-bit products are exact in float32: one rounding, as torch's
    first = ((x1 * cos).to(dt).to(tl.float32) - (x2 * sin).to(dt).to(tl.float32)).to(dt)
    second = ((x2 * cos).to(dt).to(tl.float32) + (x1 * sin).to(dt).to(tl.float32)).to(dt)
    tl.store(out_ptr + offs, first.to(out_ptr.dtype.element_ty), mask=ok)
    tl.store(out_ptr + HALF + offs, second.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _rotary_kernel(
    x_ptr, cos_ptr, sin_ptr, out_ptr,
    stride_xt, stride_xh, stride_ct, stride_ot, stride_oh,
    HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, INTERLEAVE: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_producers(PDL)
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    _rotate(x_ptr + t * stride_xt + h * stride_xh, cos_ptr + t * stride_ct, sin_ptr + t * stride_ct,
            out_ptr + t * stride_ot + h * stride_oh, HALF, BLOCK_HALF, INTERLEAVE)


@triton.jit
def _latent_entry(t, kv_ptr, w_ptr, cos_ptr, sin_ptr, slot_ptr, cache_ptr, latent_dim, eps, stride_kvt, stride_ct,
                  HALF: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_HALF: tl.constexpr, INTERLEAVE: tl.constexpr):
    """cache[slot[t]] = [RMSNorm(kv[t, :C]), rotate(kv[t, C:])]."""
    slot = tl.load(slot_ptr + t)
    entry_ptr = cache_ptr + slot * (latent_dim + 2 * HALF)
    offs = tl.arange(0, BLOCK_C)
    ok = offs < latent_dim
    x = tl.load(kv_ptr + t * stride_kvt + offs, mask=ok, other=0.0)
    x32 = x.to(tl.float32)
    normed = (x32 * tl.rsqrt(tl.sum(x32 * x32, axis=0) / latent_dim + eps)).to(x.dtype)
    w = tl.load(w_ptr + offs, mask=ok, other=0.0)
    y = (normed.to(tl.float32) * w.to(tl.float32)).to(x.dtype)
    tl.store(entry_ptr + offs, y.to(cache_ptr.dtype.element_ty), mask=ok)
    _rotate(kv_ptr + t * stride_kvt + latent_dim, cos_ptr + t * stride_ct, sin_ptr + t * stride_ct,
            entry_ptr + latent_dim, HALF, BLOCK_HALF, INTERLEAVE)


@triton.jit
def _latent_entry_kernel(
    kv_ptr, w_ptr, cos_ptr, sin_ptr, slot_ptr, cache_ptr,
    latent_dim, eps,
    stride_kvt, stride_ct,
    HALF: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_HALF: tl.constexpr, INTERLEAVE: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_producers(PDL)
    _latent_entry(tl.program_id(0).to(tl.int64), kv_ptr, w_ptr, cos_ptr, sin_ptr, slot_ptr, cache_ptr, latent_dim,
                  eps, stride_kvt, stride_ct, HALF, BLOCK_C, BLOCK_HALF, INTERLEAVE)


def _check_cos_sin(cos: torch.Tensor, sin: torch.Tensor, rows: int, half: int, dtype: torch.dtype, device) -> None:
    for name, t in (("cos", cos), ("sin", sin)):
        if tuple(t.shape) != (rows, half):
            raise ValueError(f"{name} must be [T={rows}, rope/2={half}], got {list(t.shape)}")
        if t.dtype != dtype:
            raise TypeError(f"{name} must be {dtype} (the activations' dtype), got {t.dtype}")
        if t.stride(-1) != 1 or t.device != device:
            raise ValueError(f"{name} must be contiguous in its last dimension on {device}, got strides "
                             f"{t.stride()} on {t.device}")


def rotary_into(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out: torch.Tensor, interleave: bool) -> torch.Tensor:
    """out <- x rotated (rope.rotate's result), e.g. into the rotary slice of MLA's query.

    x:        [T, H, R], bf16 / fp16 / fp32, unit stride in its last dimension (any other strides).
    cos, sin: x.dtype [T, R / 2], unit last stride (rope.rotary_cos_sin, rows flattened).
    out:      [T, H, R] on x's device, unit last stride, any dtype of DTYPES (a view is fine).
    interleave: pairs (x0, x1), ... (DeepSeek's checkpoints) rather than halves.
    Returns out.
    """
    if x.dim() != 3 or x.shape[-1] % 2:
        raise ValueError(f"x must be [T, H, R] with R even, got shape {list(x.shape)}")
    if x.dtype not in DTYPES or out.dtype not in DTYPES:
        raise TypeError(f"x and out must be one of {DTYPES}, got {x.dtype} and {out.dtype}")
    if out.shape != x.shape or out.device != x.device or out.stride(-1) != 1 or x.stride(-1) != 1:
        raise ValueError(f"x and out must both be {list(x.shape)} on {x.device} with unit last stride, got out "
                         f"{list(out.shape)} on {out.device}, strides {x.stride()} and {out.stride()}")
    rows, heads, width = x.shape
    _check_cos_sin(cos, sin, rows, width // 2, x.dtype, x.device)
    require_kernel_device(x.device, "rotary_into")
    if rows and heads:
        _rotary_kernel[(rows, heads)](
            x, cos, sin, out,
            x.stride(0), x.stride(1), cos.stride(0), out.stride(0), out.stride(1),
            HALF=width // 2, BLOCK_HALF=triton.next_power_of_2(width // 2), INTERLEAVE=interleave, num_warps=1,
            **launch_flags(x.device),
        )
    return out


def check_latent_inputs(kv: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                        cache: torch.Tensor, slot_mapping: torch.Tensor) -> tuple[int, int, int]:
    """write_latent_entries' checks (its docstring has the contract); returns (rows, C, R)."""
    if kv.dim() != 2 or kv.dtype not in DTYPES or kv.stride(-1) != 1:
        raise ValueError(f"kv must be [T, C + R], one of {DTYPES}, unit last stride; got {kv.dtype} "
                         f"{list(kv.shape)} strides {kv.stride()}")
    rows, width = kv.shape
    if weight.dim() != 1 or weight.dtype != kv.dtype or weight.device != kv.device:
        raise ValueError(f"weight must be {kv.dtype} [C] on {kv.device}, got {weight.dtype} {list(weight.shape)} "
                         f"on {weight.device}")
    latent = weight.shape[0]
    rope = width - latent
    if rope <= 0 or rope % 2:
        raise ValueError(f"kv's width {width} must be weight's size {latent} plus an even rotary size")
    _check_cos_sin(cos, sin, rows, rope // 2, kv.dtype, kv.device)
    if cache.shape[-1] != width or cache.dtype not in DTYPES or not cache.is_contiguous() or cache.device != kv.device:
        raise ValueError(f"cache must be contiguous [..., {width}] on {kv.device}, one of {DTYPES}; got {cache.dtype} "
                         f"{list(cache.shape)} on {cache.device}")
    if slot_mapping.shape != (rows,) or slot_mapping.dtype != torch.int64 or not slot_mapping.is_contiguous():
        raise ValueError(f"slot_mapping must be contiguous int64 [T={rows}], got {slot_mapping.dtype} "
                         f"{list(slot_mapping.shape)}")
    if slot_mapping.device != kv.device:
        raise ValueError(f"slot_mapping is on {slot_mapping.device} but kv is on {kv.device}")
    return rows, latent, rope


def write_latent_entries(kv: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor,
                         cache: torch.Tensor, slot_mapping: torch.Tensor, interleave: bool) -> None:
    """cache[slot_mapping[t]] <- [RMSNorm(kv[t, :C]), rotate(kv[t, C:])], cast to cache.dtype.

    kv:           [T, C + R] (kv_a_proj_with_mqa's output: latent, then the shared rotary key),
                  bf16 / fp16 / fp32, unit last stride, any row stride.
    weight:       kv.dtype [C] (kv_a_layernorm.weight); eps its epsilon.
    cos, sin:     kv.dtype [T, R / 2], unit last stride (rope.rotary_cos_sin, rows flattened).
    cache:        [num_pages, page_size, C + R] (or any [..., C + R]), contiguous, one of DTYPES.
    slot_mapping: int64 [T], contiguous: flat slot (page * page_size + offset) of each row, in
                  range (ForwardMeta.slot_mapping; not checked: that would read it back).
    """
    rows, latent, rope = check_latent_inputs(kv, weight, cos, sin, cache, slot_mapping)
    require_kernel_device(kv.device, "write_latent_entries")
    if rows:
        _latent_entry_kernel[(rows,)](
            kv, weight.contiguous(), cos, sin, slot_mapping, cache,
            latent, eps,
            kv.stride(0), cos.stride(0),
            HALF=rope // 2, BLOCK_C=triton.next_power_of_2(latent), BLOCK_HALF=triton.next_power_of_2(rope // 2),
            INTERLEAVE=interleave, num_warps=ENTRY_WARPS, **launch_flags(kv.device),
        )
