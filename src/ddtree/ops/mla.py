"""MLA's small per-row steps as Triton kernels, for the paged (verify / decode) forward.

    _rotary_kernel        out[t, h] = rotate(x[t, h]) by cos[t], sin[t]: the query's rotary part,
                          written straight into its slot of the attention query (no torch.cat)
    _latent_entry_kernel  cache[slot[t]] = [RMSNorm(latent[t]), rotate(k_rope[t])]: norm, rotary,
                          concatenation, cast and cache write of one token's entry in one launch

    absorbed_query        a decode step's query and cache entries in one launch (below)

Rounding follows the PyTorch path (MLA.rotated, rope.rotate): the rotary products and their sum
are each rounded to the activation dtype, the norm as in norm.py. Grids depend on the
shapes only: CUDA-graph capturable.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .gemm import BLOCK_M, MAX_ROWS, NUM_STAGES, NUM_WARPS, block_k_for
from .launch import DTYPES, dot_flags, launch_flags, matmul_tile, require_kernel_device, wait_for_producers
# Warps of the cache-entry kernel: absorbed_query's launch (gemm.NUM_WARPS) writes the same entries
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


def rotary_into(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out: torch.Tensor, interleave: bool, *,
                pdl: bool = True) -> torch.Tensor:
    """out <- x rotated (rope.rotate's result), e.g. into the rotary slice of MLA's query.

    x:        [T, H, R], bf16 / fp16 / fp32, unit stride in its last dimension (any other strides).
    cos, sin: x.dtype [T, R / 2], unit last stride (rope.rotary_cos_sin, rows flattened).
    out:      [T, H, R] on x's device, unit last stride, any dtype of DTYPES (a view is fine).
    interleave: pairs (x0, x1), ... (DeepSeek's checkpoints) rather than halves; pdl: ops/launch.py.
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
            **launch_flags(x.device, pdl),
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
                         cache: torch.Tensor, slot_mapping: torch.Tensor, interleave: bool, *, pdl: bool = True) -> None:
    """cache[slot_mapping[t]] <- [RMSNorm(kv[t, :C]), rotate(kv[t, C:])], cast to cache.dtype.

    kv:           [T, C + R] (kv_a_proj_with_mqa's output: latent, then the shared rotary key),
                  bf16 / fp16 / fp32, unit last stride, any row stride.
    weight:       kv.dtype [C] (kv_a_layernorm.weight); eps its epsilon.
    cos, sin:     kv.dtype [T, R / 2], unit last stride (rope.rotary_cos_sin, rows flattened).
    cache:        [num_pages, page_size, C + R] (or any [..., C + R]), contiguous, one of DTYPES.
    slot_mapping: int64 [T], contiguous: flat slot (page * page_size + offset) of each row, in
                  range (ForwardMeta.slot_mapping; not checked: that would read it back).
    pdl:          ops/launch.py.
    """
    rows, latent, rope = check_latent_inputs(kv, weight, cos, sin, cache, slot_mapping)
    require_kernel_device(kv.device, "write_latent_entries")
    if rows:
        _latent_entry_kernel[(rows,)](
            kv, weight.contiguous(), cos, sin, slot_mapping, cache,
            latent, eps,
            kv.stride(0), cos.stride(0),
            HALF=rope // 2, BLOCK_C=triton.next_power_of_2(latent), BLOCK_HALF=triton.next_power_of_2(rope // 2),
            INTERLEAVE=interleave, num_warps=ENTRY_WARPS, **launch_flags(kv.device, pdl),
        )


# ----------------------------------------------------------------------------------------------
# absorbed_query: a decode step's MLA query and cache entries in one launch (three before: a
# batched GEMM, the query's rotary kernel and the cache-entry kernel). One 1-D grid, three kinds of
# program, told apart by their id:
#
#     [0, G)              query[:, h, :C] = q_nope[:, h] @ W_UK[h]: gemm.py's tiles, G = heads x C tiles
#     [G, G + T * H)      query[t, h, C:] = rotate(q_rope[t, h])                         (_rotate)
#     [G + T * H, + T)    cache[slot[t]] = [RMSNorm(kv[t, :C]), rotate(kv[t, C:])]      (_latent_entry)
#
# The rotary and the cache entries run the same code per element as the kernels above; the GEMM is
# launch.matmul_tile (tests/ops/test_absorbed_query.py compares all three).

if NUM_WARPS != ENTRY_WARPS:  # one warp count for the launch: entries must reduce as write_latent_entries does
    raise ImportError(f"absorbed_query launches {NUM_WARPS} warps, ENTRY_WARPS is {ENTRY_WARPS}")
BLOCK_N = 32  # latent columns per GEMM program: 16 heads x 512 / 32 = 256 programs at Moonlight's shape


@triton.jit
def _absorbed_query_kernel(
    q_ptr, w_ptr, query_ptr, kv_ptr, norm_w_ptr, cos_ptr, sin_ptr, slot_ptr, cache_ptr,
    rows, heads, nope, latent, n_tiles, eps,
    stride_qt, stride_qh, stride_wh, stride_wk, stride_yt, stride_yh, stride_kvt, stride_ct,
    HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_C: tl.constexpr, INTERLEAVE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_F32: tl.constexpr, PRECISION: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_producers(PDL)
    pid = tl.program_id(0)
    gemm_programs = n_tiles * heads
    if pid < gemm_programs:
        h = (pid // n_tiles).to(tl.int64)
        offs_m = tl.arange(0, BLOCK_M)
        offs_n = (pid % n_tiles) * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        m_ok = offs_m < rows
        n_ok = offs_n < latent
        x_ptrs = q_ptr + offs_m[:, None] * stride_qt + h * stride_qh + offs_k[None, :]
        w_ptrs = w_ptr + h * stride_wh + offs_k[:, None] * stride_wk + offs_n[None, :]
        acc = matmul_tile(x_ptrs, w_ptrs, BLOCK_K, BLOCK_K * stride_wk, m_ok, n_ok, nope,
                           BLOCK_M, BLOCK_N, BLOCK_K, DOT_F32, PRECISION)
        y_ptrs = query_ptr + offs_m[:, None] * stride_yt + h * stride_yh + offs_n[None, :]
        tl.store(y_ptrs, acc.to(query_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])
    elif pid < gemm_programs + rows * heads:
        j = pid - gemm_programs
        t = (j // heads).to(tl.int64)
        h = (j % heads).to(tl.int64)
        _rotate(q_ptr + t * stride_qt + h * stride_qh + nope, cos_ptr + t * stride_ct, sin_ptr + t * stride_ct,
                query_ptr + t * stride_yt + h * stride_yh + latent, HALF, BLOCK_HALF, INTERLEAVE)
    else:
        t = (pid - gemm_programs - rows * heads).to(tl.int64)
        _latent_entry(t, kv_ptr, norm_w_ptr, cos_ptr, sin_ptr, slot_ptr, cache_ptr, latent, eps, stride_kvt, stride_ct,
                      HALF, BLOCK_C, BLOCK_HALF, INTERLEAVE)


def absorbed_query(q: torch.Tensor, w_uk: torch.Tensor, kv: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                   cos: torch.Tensor, sin: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor,
                   interleave: bool, *, pdl: bool = True) -> torch.Tensor:
    """The attention query of at most gemm.MAX_ROWS rows, and their cache entries written.

    q:        [T, H, nope + R] (MLA.project's query, rows flattened), unit last stride.
    w_uk:     q.dtype [H, nope, C], unit last stride (kv_b_proj's W_UK part, MLA.absorbed_weight).
    kv, norm_weight, eps, cos, sin, cache, slot_mapping: as write_latent_entries.
    interleave: rotary pairs interleaved (DeepSeek's checkpoints) rather than halves; pdl: ops/launch.py.
    Returns query [T, H, C + R] in q.dtype: q_nope absorbed into the latent, then q_rope rotated.
    """
    rows, latent, rope = check_latent_inputs(kv, norm_weight, cos, sin, cache, slot_mapping)
    if q.dim() != 3 or q.shape[0] != rows or q.stride(-1) != 1 or q.dtype != kv.dtype or q.device != kv.device:
        raise ValueError(f"q must be {kv.dtype} [T={rows}, H, nope + {rope}] with unit last stride on {kv.device}, "
                         f"got {q.dtype} {list(q.shape)} strides {q.stride()}")
    heads, nope = q.shape[1], q.shape[2] - rope
    if (tuple(w_uk.shape) != (heads, nope, latent) or w_uk.stride(-1) != 1 or w_uk.dtype != q.dtype
            or w_uk.device != q.device):
        raise ValueError(f"w_uk must be {q.dtype} [{heads}, {nope}, {latent}] with unit last stride on {q.device}, "
                         f"got {w_uk.dtype} {list(w_uk.shape)} strides {w_uk.stride()} on {w_uk.device}")
    if rows > MAX_ROWS:
        raise ValueError(f"absorbed_query takes at most {MAX_ROWS} rows, got {rows}")
    require_kernel_device(q.device, "absorbed_query")
    query = torch.empty(rows, heads, latent + rope, dtype=q.dtype, device=q.device)
    if rows == 0:
        return query
    n_tiles = triton.cdiv(latent, BLOCK_N)
    _absorbed_query_kernel[(n_tiles * heads + rows * heads + rows,)](
        q, w_uk, query, kv, norm_weight.contiguous(), cos, sin, slot_mapping, cache,
        rows, heads, nope, latent, n_tiles, eps,
        q.stride(0), q.stride(1), w_uk.stride(0), w_uk.stride(1), query.stride(0), query.stride(1),
        kv.stride(0), cos.stride(0),
        HALF=rope // 2, BLOCK_HALF=triton.next_power_of_2(rope // 2), BLOCK_C=triton.next_power_of_2(latent),
        INTERLEAVE=interleave, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
        BLOCK_K=block_k_for(nope), **dot_flags(q.dtype), num_warps=NUM_WARPS, num_stages=NUM_STAGES,
        **launch_flags(q.device, pdl),
    )
    return query
