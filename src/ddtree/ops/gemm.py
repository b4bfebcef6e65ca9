"""GEMMs of a few rows (a decode step's projections) as one Triton kernel that spreads the weight
read over the whole GPU.

At M = 1 cuBLAS picks 64 x 8 output tiles: MLA's q / kv_a projection (N = 3648 at Moonlight's
shape) runs on 57 thread blocks, o_proj (N = 2048) on 32 and the router (N = 64) on one, so at
most half the H200's 132 multiprocessors stream the weight (profile in docs/notes/engine_speed.md).
Here each program owns BLOCK_N output columns for all rows (M <= 16: one tl.dot tile) and the
column block shrinks (64, 32, 16) until the launch has PROGRAMS_PER_SM programs per multiprocessor.

    out[b, m, n] = sum_k x[b, m, k] * w[b, k, n]     (float32 accumulation, one rounding)

Any strides: an nn.Linear weight [N, K] is w = weight.t(); MLA's absorbed per-head products are
batched over heads. The grid depends on the shapes only: CUDA-graph capturable.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .launch import DTYPES, dot_flags, launch_flags, matmul_tile, multiprocessors, require_kernel_device, wait_for_producers

BLOCK_M = 16
MAX_ROWS = BLOCK_M  # rows per call: one tl.dot tile; larger batches go to cuBLAS, whose tiles fill the GPU
# Tiles from a sweep at decode shapes (dev/decode_sweep_skinny.py, benchmarks/results/decode_sweeps/)
BLOCK_K = 512
NUM_WARPS = 2
NUM_STAGES = 3
PROGRAMS_PER_SM = 4  # block_n_for: keep narrowing the column block until the launch has this many


@triton.jit
def _skinny_kernel(
    x_ptr, w_ptr, out_ptr, M, N, K,
    stride_xb, stride_xm, stride_xk, stride_wb, stride_wk, stride_wn, stride_ob, stride_om, stride_on,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_F32: tl.constexpr, PRECISION: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_producers(PDL)
    pid_n = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    n_ok = offs_n < N
    x_ptrs = x_ptr + b * stride_xb + offs_m[:, None] * stride_xm + offs_k[None, :] * stride_xk
    w_ptrs = w_ptr + b * stride_wb + offs_k[:, None] * stride_wk + offs_n[None, :].to(tl.int64) * stride_wn
    acc = matmul_tile(x_ptrs, w_ptrs, BLOCK_K * stride_xk, BLOCK_K * stride_wk, m_ok, n_ok, K,
                       BLOCK_M, BLOCK_N, BLOCK_K, DOT_F32, PRECISION)
    out_ptrs = out_ptr + b * stride_ob + offs_m[:, None] * stride_om + offs_n[None, :] * stride_on
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def block_n_for(batch: int, n: int, sms: int) -> int:
    """Output columns per program: the widest of 64, 32, 16 whose launch still has PROGRAMS_PER_SM
    programs per multiprocessor, else 16 (spread a small weight as thin as it goes)."""
    for block_n in (64, 32):
        if batch * triton.cdiv(n, block_n) >= PROGRAMS_PER_SM * sms:
            return block_n
    return 16


def block_k_for(depth: int) -> int:
    """K step: BLOCK_K, or the depth's power of two (at least 16) when the depth is smaller."""
    return min(BLOCK_K, max(16, triton.next_power_of_2(depth)))


def skinny_matmul(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None, *,
                  out_dtype: torch.dtype | None = None, block_n: int | None = None, block_k: int | None = None,
                  num_warps: int = NUM_WARPS, num_stages: int = NUM_STAGES, pdl: bool = True) -> torch.Tensor:
    """out = x @ w, batched, for few rows.

    x:   [B, M, K], bf16 / fp16 / fp32, any strides, M <= MAX_ROWS.
    w:   x.dtype [B, K, N], any strides (an nn.Linear weight [N, K] as weight.t()[None]).
    out: optional [B, M, N] of out_dtype, any strides (a view into a consumer's buffer is fine).
    out_dtype: the result's dtype (default x.dtype; float32 for the router's logits).
    block_n, block_k, num_warps, num_stages: tuning (None: block_n_for, and BLOCK_K or K's power of two
               when K is smaller); pdl: ops/launch.py.
    Returns out [B, M, N], accumulated in float32 and rounded once.
    """
    if x.dim() != 3 or w.dim() != 3 or w.shape[0] != x.shape[0] or w.shape[1] != x.shape[2]:
        raise ValueError(f"x must be [B, M, K] and w [B, K, N], got {list(x.shape)} and {list(w.shape)}")
    batch, rows, depth = x.shape
    cols = w.shape[2]
    if rows > MAX_ROWS:
        raise ValueError(f"skinny_matmul takes at most {MAX_ROWS} rows, got {rows}")
    if x.dtype not in DTYPES or w.dtype != x.dtype:
        raise TypeError(f"x must be one of {DTYPES} and w the same, got {x.dtype} and {w.dtype}")
    out_dtype = out_dtype or x.dtype
    if out is None:
        out = torch.empty(batch, rows, cols, dtype=out_dtype, device=x.device)
    if tuple(out.shape) != (batch, rows, cols) or out.dtype != out_dtype:
        raise ValueError(f"out must be {out_dtype} {[batch, rows, cols]}, got {out.dtype} {list(out.shape)}")
    for name, t in (("w", w), ("out", out)):
        if t.device != x.device:
            raise ValueError(f"{name} is on {t.device} but x is on {x.device}")
    require_kernel_device(x.device, "skinny_matmul")
    if batch * rows * cols == 0:
        return out
    if depth == 0:
        return out.zero_()
    block_n = block_n or block_n_for(batch, cols, multiprocessors(x.device))
    block_k = block_k or block_k_for(depth)
    for name, size in (("block_n", block_n), ("block_k", block_k)):
        if size < 16 or size & (size - 1):
            raise ValueError(f"{name} must be a power of two >= 16 (tl.dot), got {size}")
    _skinny_kernel[(triton.cdiv(cols, block_n), batch)](
        x, w, out, rows, cols, depth, *x.stride(), *w.stride(), *out.stride(),
        BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=block_k,
        **dot_flags(x.dtype), num_warps=num_warps, num_stages=num_stages, **launch_flags(x.device, pdl),
    )
    return out


def linear(x: torch.Tensor, weight: torch.Tensor, *, out_dtype: torch.dtype | None = None, max_rows: int = MAX_ROWS,
           pdl: bool = True) -> torch.Tensor:
    """F.linear(x, weight) (no bias) for x [..., K] and weight [N, K]: skinny_matmul when x has at
    most max_rows (<= MAX_ROWS; KernelPolicy.gemm_max_rows) rows, else cuBLAS (torch.mm with
    out_dtype where one is asked; on the CPU, the GEMM in out_dtype). Returns [..., N] in
    out_dtype (default x.dtype)."""
    rows = x.reshape(math.prod(x.shape[:-1]), x.shape[-1])
    if rows.shape[0] > min(max_rows, MAX_ROWS):
        if out_dtype is None or out_dtype == x.dtype:
            return F.linear(x, weight)
        if not x.is_cuda:  # torch.mm's out_dtype is CUDA-only
            return F.linear(x.to(out_dtype), weight.to(out_dtype))
        return torch.mm(rows, weight.t(), out_dtype=out_dtype).view(*x.shape[:-1], weight.shape[0])
    out = skinny_matmul(rows[None], weight.t()[None], out_dtype=out_dtype, pdl=pdl)
    return out.view(*x.shape[:-1], weight.shape[0])
