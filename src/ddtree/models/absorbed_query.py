"""A decode step's MLA query and cache entries in one launch (three before: a batched GEMM, the
query's rotary kernel and the cache-entry kernel, about 6.5 us a layer on the H200).

One 1-D grid, three kinds of program, told apart by their id:

    [0, G)              query[:, h, :C] = q_nope[:, h] @ W_UK[h]: skinny tiles (skinny.py), G = heads x C tiles
    [G, G + T * H)      query[t, h, C:] = rotate(q_rope[t, h])                         (fused_mla._rotate)
    [G + T * H, + T)    cache[slot[t]] = [RMSNorm(kv[t, :C]), rotate(kv[t, C:])]      (fused_mla._latent_entry)

The rotary and the cache entries run the same code per element as the separate kernels; the GEMM
is skinny_matmul's tile (fused_moe_kernels._matmul_tile) (tests/models/test_absorbed_query.py compares all three).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..kernels import require_kernel_device
from ..pdl import launch_flags, wait_for_producers
from .fused_mla import ENTRY_WARPS, _latent_entry, _rotate, check_latent_inputs
from .fused_moe_kernels import _matmul_tile, dot_flags
from .skinny import BLOCK_M, MAX_ROWS, NUM_STAGES, NUM_WARPS, block_k_for

if NUM_WARPS != ENTRY_WARPS:  # one warp count for the launch: entries must reduce as write_latent_entries does
    raise ImportError(f"absorbed_query launches {NUM_WARPS} warps, fused_mla.ENTRY_WARPS is {ENTRY_WARPS}")
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
        acc = _matmul_tile(x_ptrs, w_ptrs, BLOCK_K, BLOCK_K * stride_wk, m_ok, n_ok, nope,
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
                   interleave: bool) -> torch.Tensor:
    """The attention query of at most skinny.MAX_ROWS rows, and their cache entries written.

    q:        [T, H, nope + R] (MLA.project's query, rows flattened), unit last stride.
    w_uk:     q.dtype [H, nope, C], unit last stride (kv_b_proj's W_UK part, MLA.absorbed_weight).
    kv, norm_weight, eps, cos, sin, cache, slot_mapping: as fused_mla.write_latent_entries.
    interleave: rotary pairs interleaved (DeepSeek's checkpoints) rather than halves.
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
        **launch_flags(q.device),
    )
    return query
