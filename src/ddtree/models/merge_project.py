"""The split-KV merge of a decode step's attention and MLA's W_UV product in one launch.

tree_verify_mla splits the keys of a short query set across programs (flash-decoding) and merges
the partial outputs in a second kernel; absorbed_attention then multiplies the merged latent by
W_UV per head. Here each program merges the partials of one head for all rows on the fly, K step
by K step, and feeds them to its W_UV tile:

    w[m, s] = exp(lse[m, s] - max_s lse[m, s])
    o[m, :] = sum_s w[m, s] part[m, s, :] / sum_s w[m, s]        (rounded to W_UV's dtype)
    out[m, h, n] = o[m, :] @ W_UV[h, :, n]

The merge is tree_verify's _merge_splits_kernel's (exp, the weighted sum, one divide), summed over
the splits in order instead of as a tree. Not yet timed on a GPU: MLA takes it only when
FUSE_MERGE is set (off by default).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..kernels import require_kernel_device
from ..pdl import launch_flags, wait_for_producers
from .fused_moe_kernels import _dot, dot_flags
from .skinny import BLOCK_M, MAX_ROWS, NUM_STAGES, NUM_WARPS

FUSE_MERGE = False  # absorbed_attention's switch, until an H200 run says it pays
BLOCK_N = 32  # value columns per program: 16 heads x 128 / 32 = 64 programs at Moonlight's shape
BLOCK_K = 128  # latent columns per step: 18 splits x [16, 128] float32 partials in flight


@triton.jit
def _merge_project_kernel(
    part_ptr, lse_ptr, w_ptr, out_ptr, rows, splits, latent, values,
    stride_pm, stride_ph, stride_ps, stride_lm, stride_lh, stride_wh, stride_wk, stride_wn, stride_om, stride_oh,
    SPLITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_F32: tl.constexpr, PRECISION: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_producers(PDL)
    pid_n = tl.program_id(0)
    h = tl.program_id(1).to(tl.int64)
    offs_m = tl.arange(0, BLOCK_M)
    offs_s = tl.arange(0, SPLITS)
    m_ok = offs_m < rows
    lse = tl.load(lse_ptr + offs_m[:, None] * stride_lm + h * stride_lh + offs_s[None, :],
                  mask=m_ok[:, None] & (offs_s < splits)[None, :], other=float("-inf"))
    top = tl.max(lse, 1)
    top = tl.where(top == float("-inf"), 0.0, top)
    weight = tl.exp(lse - top[:, None])  # [BLOCK_M, SPLITS]; empty splits and padding rows: 0
    total = tl.sum(weight, 1)
    total = tl.where(total > 0, total, 1.0)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < values
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, latent, BLOCK_K):
        k = k0 + offs_k
        k_ok = k < latent
        merged = tl.zeros([BLOCK_M, BLOCK_K], tl.float32)
        for s in range(0, splits):
            w_s = tl.sum(tl.where(offs_s[None, :] == s, weight, 0.0), 1)
            p = tl.load(part_ptr + offs_m[:, None] * stride_pm + h * stride_ph + s * stride_ps + k[None, :],
                        mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            merged += p.to(tl.float32) * w_s[:, None]
        a = (merged / total[:, None]).to(w_ptr.dtype.element_ty)
        w = tl.load(w_ptr + h * stride_wh + k[:, None] * stride_wk + offs_n[None, :] * stride_wn,
                    mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        acc = _dot(a, w, acc, DOT_F32, PRECISION)
    out_ptrs = out_ptr + offs_m[:, None] * stride_om + h * stride_oh + offs_n[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def merge_project(part: torch.Tensor, part_lse: torch.Tensor, w_uv: torch.Tensor,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """Merge split-KV partials and multiply by W_UV, for at most skinny.MAX_ROWS rows.

    part:     [M, H, S, C] float32 (or any float dtype), unit last stride: tree_verify_mla's
              partials with merge=False, rows flattened (M = B * N).
    part_lse: float32 [M, H, S], unit last stride: their log-sum-exps (-inf: an empty split).
    w_uv:     [H, C, V] in the output dtype, unit stride in V or C (kv_b_proj's W_UV part).
    out:      optional [M, H, V] of w_uv's dtype, unit last stride (a view into o_proj's input).
    Returns out: per row and head, the merged latent (rounded to w_uv's dtype) times W_UV[h].
    """
    if part.dim() != 4 or part_lse.shape != part.shape[:3] or w_uv.dim() != 3:
        raise ValueError(f"part must be [M, H, S, C], part_lse [M, H, S] and w_uv [H, C, V], got "
                         f"{list(part.shape)}, {list(part_lse.shape)} and {list(w_uv.shape)}")
    rows, heads, splits, latent = part.shape
    if tuple(w_uv.shape[:2]) != (heads, latent):
        raise ValueError(f"w_uv must be [H={heads}, C={latent}, V], got {list(w_uv.shape)}")
    if rows > MAX_ROWS:
        raise ValueError(f"merge_project takes at most {MAX_ROWS} rows, got {rows}")
    if part.stride(-1) != 1 or part_lse.stride(-1) != 1 or part_lse.dtype != torch.float32:
        raise ValueError("part and part_lse (float32) must have unit last strides")
    values = w_uv.shape[2]
    if out is None:
        out = torch.empty(rows, heads, values, dtype=w_uv.dtype, device=part.device)
    if tuple(out.shape) != (rows, heads, values) or out.dtype != w_uv.dtype or out.stride(-1) != 1:
        raise ValueError(f"out must be {w_uv.dtype} [{rows}, {heads}, {values}] with unit last stride, got "
                         f"{out.dtype} {list(out.shape)}")
    for name, t in (("part_lse", part_lse), ("w_uv", w_uv), ("out", out)):
        if t.device != part.device:
            raise ValueError(f"{name} is on {t.device} but part is on {part.device}")
    require_kernel_device(part.device, "merge_project")
    if rows * heads * values == 0:
        return out
    _merge_project_kernel[(triton.cdiv(values, BLOCK_N), heads)](
        part, part_lse, w_uv, out, rows, splits, latent, values,
        part.stride(0), part.stride(1), part.stride(2), part_lse.stride(0), part_lse.stride(1),
        *w_uv.stride(), out.stride(0), out.stride(1),
        SPLITS=triton.next_power_of_2(splits), BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
        **dot_flags(w_uv.dtype), num_warps=NUM_WARPS, num_stages=NUM_STAGES, **launch_flags(part.device),
    )
    return out
