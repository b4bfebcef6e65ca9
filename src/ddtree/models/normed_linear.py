"""RMSNorm(x + delta) followed by a GEMM of few rows, in one launch: the decode step's norm moves
into the prologue of the projection that reads it (MLA's q / kv_a, the router).

A decoder layer's two norms were two launches of about 2 us each per layer at a decode step (55 in
a Moonlight forward, 0.10 ms of its 2.5). Here every program of the GEMM recomputes the row
statistics (the rows are a few KB, read from L2) and normalizes its K steps on the fly; program 0
also stores the residual sum s and, when asked, the normalized rows h for later readers (the MoE).

    s = x + delta (rounded to x.dtype)      h = w_norm * normalize(s)      out = h @ W^T

Rounding as fused_norm.py's kernel (the sum of squares in K steps, so its last bits may differ).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton import knobs

from ..kernels import require_kernel_device
from .fused_moe_kernels import _dot
from .skinny import BLOCK_M, MAX_ROWS, NUM_STAGES, block_n_for

# Narrower K steps and more warps than skinny's plain GEMM: each step also holds the rows' residual,
# normalized and scaled tiles ([16, BLOCK_K] each), which at 512 x 2 warps spill (sm_90 compile).
BLOCK_K = 128
NUM_WARPS = 4


@triton.jit
def _residual(x_ptrs, d_ptrs, mask, HAS_DELTA: tl.constexpr):
    s = tl.load(x_ptrs, mask=mask, other=0.0)
    if HAS_DELTA:
        s = (s.to(tl.float32) + tl.load(d_ptrs, mask=mask, other=0.0).to(tl.float32)).to(s.dtype)
    return s


@triton.jit
def _normed_skinny_kernel(
    x_ptr, delta_ptr, norm_w_ptr, w_ptr, out_ptr, sum_ptr, h_ptr,
    M, N, K, eps,
    stride_xm, stride_dm, stride_wk, stride_wn, stride_om, stride_sm, stride_hm,
    HAS_DELTA: tl.constexpr, WRITE_SUM: tl.constexpr, WRITE_H: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_F32: tl.constexpr, PRECISION: tl.constexpr,
):
    pid_n = tl.program_id(0)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    n_ok = offs_n < N
    writer = pid_n == 0  # one program stores s and h
    sum_sq = tl.zeros([BLOCK_M], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + offs_k
        mask = m_ok[:, None] & (k < K)[None, :]
        s = _residual(x_ptr + offs_m[:, None] * stride_xm + k[None, :],
                      delta_ptr + offs_m[:, None] * stride_dm + k[None, :], mask, HAS_DELTA)
        s32 = s.to(tl.float32)
        sum_sq += tl.sum(s32 * s32, axis=1)
        if WRITE_SUM:
            tl.store(sum_ptr + offs_m[:, None] * stride_sm + k[None, :], s, mask=mask & writer)
    rstd = tl.rsqrt(sum_sq / K + eps)
    w_ptrs = w_ptr + offs_k[:, None] * stride_wk + offs_n[None, :].to(tl.int64) * stride_wn
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + offs_k
        k_ok = k < K
        mask = m_ok[:, None] & k_ok[None, :]
        s = _residual(x_ptr + offs_m[:, None] * stride_xm + k[None, :],
                      delta_ptr + offs_m[:, None] * stride_dm + k[None, :], mask, HAS_DELTA)
        normed = (s.to(tl.float32) * rstd[:, None]).to(s.dtype)
        scale = tl.load(norm_w_ptr + k, mask=k_ok, other=0.0).to(tl.float32)
        h = (normed.to(tl.float32) * scale[None, :]).to(s.dtype)
        if WRITE_H:
            tl.store(h_ptr + offs_m[:, None] * stride_hm + k[None, :], h, mask=mask & writer)
        w = tl.load(w_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        acc = _dot(h, w, acc, DOT_F32, PRECISION)
        w_ptrs += BLOCK_K * stride_wk
    out_ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


@functools.lru_cache(maxsize=None)
def _multiprocessors(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 8


def _rows(t: torch.Tensor, name: str, shape) -> None:
    if tuple(t.shape) != tuple(shape) or t.stride(-1) != 1:
        raise ValueError(f"{name} must be {list(shape)} with unit last stride, got {list(t.shape)} strides {t.stride()}")


def normed_linear(x: torch.Tensor, delta: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                  weight: torch.Tensor, *, out_dtype: torch.dtype | None = None, want_h: bool = False,
                  block_n: int | None = None) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """out = RMSNorm(x + delta) @ weight^T for at most skinny.MAX_ROWS rows, in one launch.

    x, delta:    [M, K] bf16 / fp16 / fp32, unit last stride (delta optional: then s = x).
    norm_weight: x.dtype [K], contiguous (RMSNorm.weight); eps its epsilon.
    weight:      x.dtype [N, K], any strides (an nn.Linear weight, or a joint view of two).
    out_dtype:   the GEMM's output dtype (default x.dtype; float32 for the router's logits).
    want_h:      also return the normalized rows h (for other readers of the norm's output).
    Returns (out [M, N], s [M, K] = x + delta or None without delta, h [M, K] or None).
    """
    rows, depth = x.shape if x.dim() == 2 else (None, None)
    if rows is None or rows > MAX_ROWS:
        raise ValueError(f"x must be [M <= {MAX_ROWS}, K], got {list(x.shape)}")
    _rows(x, "x", (rows, depth))
    if delta is not None:
        _rows(delta, "delta", (rows, depth))
    if weight.dim() != 2 or weight.shape[1] != depth:
        raise ValueError(f"weight must be [N, K={depth}], got {list(weight.shape)}")
    if norm_weight.shape != (depth,) or not norm_weight.is_contiguous():
        raise ValueError(f"norm_weight must be contiguous [K={depth}], got {list(norm_weight.shape)}")
    for name, t in (("delta", delta), ("norm_weight", norm_weight), ("weight", weight)):
        if t is not None and (t.dtype != x.dtype or t.device != x.device):
            raise ValueError(f"{name} must be {x.dtype} on {x.device}, got {t.dtype} on {t.device}")
    require_kernel_device(x.device, "normed_linear")
    cols = weight.shape[0]
    out = torch.empty(rows, cols, dtype=out_dtype or x.dtype, device=x.device)
    total = torch.empty_like(x) if delta is not None else None
    h = torch.empty_like(x) if want_h else None
    if rows == 0:
        return out, total, h
    block_n = block_n or block_n_for(1, cols, _multiprocessors(x.device))
    _normed_skinny_kernel[(triton.cdiv(cols, block_n),)](
        x, delta if delta is not None else x, norm_weight, weight, out,
        total if total is not None else x, h if h is not None else x,
        rows, cols, depth, eps,
        x.stride(0), delta.stride(0) if delta is not None else 0, weight.stride(1), weight.stride(0), out.stride(0),
        total.stride(0) if total is not None else 0, h.stride(0) if h is not None else 0,
        HAS_DELTA=delta is not None, WRITE_SUM=total is not None, WRITE_H=want_h,
        BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=min(BLOCK_K, max(16, triton.next_power_of_2(depth))),
        DOT_F32=x.dtype == torch.bfloat16 and knobs.runtime.interpret,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32", num_warps=NUM_WARPS, num_stages=NUM_STAGES,
    )
    return out, total, h
