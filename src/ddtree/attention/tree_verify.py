"""Tree-verify MLA attention in Triton: paged latent KV cache, ancestor-only tree mask.

Each program owns a tile of BLOCK_M query rows of one request, rows packed as (node, head) so one
tile of 64 rows is one node's 64 heads (Kimi K2) and every KV tile feeds all of them: the prefix is
read once per tile of rows, not once per head. QK^T runs as two tensor-core products (512 latent
dims + 64 rotary dims) and the latent part of the same KV tile is V. Only KV tiles that reach the
tree slots load the bitmask. For long prefixes with few row tiles, the key range is split across
programs (flash-decoding) and the partial results are merged by log-sum-exp.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..ops.launch import wait_for_producers

LOG2E = 1.4426950408889634  # 1 / ln 2


@triton.jit
def _dot(a, b, acc, DOT_F32: tl.constexpr):
    # DOT_F32: Triton 3.6's interpreter multiplies bf16 bit patterns as integers, so CPU runs
    # upcast bf16 operands (exactly) first; GPU runs always use the bf16/fp16 tensor cores.
    if DOT_F32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
    return tl.dot(a, b, acc)


@triton.jit
def tree_verify_kernel(
    q_ptr, kv_ptr, block_table_ptr, prefix_ptr, num_rows_ptr, vis_ptr,
    out_ptr, lse_ptr,
    stride_qb, stride_qn, stride_qh,
    stride_kvp, stride_kvs,
    stride_btb, stride_visb, stride_visn,
    stride_ob, stride_on, stride_oh, stride_os,
    stride_lb, stride_ln, stride_lh, stride_ls,
    qk_scale, rows_per_req, heads, page_size, num_splits,
    D_V: tl.constexpr, D_ROPE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_F32: tl.constexpr,
):
    pid_m = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2)
    prefix = tl.load(prefix_ptr + b)
    n_valid = tl.load(num_rows_ptr + b).to(tl.int32)
    kv_len = prefix + n_valid  # tree slots past num_rows may be stale: never read

    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    node = rows // heads
    head = rows % heads
    row_ok = (rows < rows_per_req) & (node < n_valid)
    offs_v = tl.arange(0, D_V)
    offs_r = tl.arange(0, D_ROPE)
    q_row = q_ptr + b * stride_qb + node[:, None] * stride_qn + head[:, None] * stride_qh
    q_nope = tl.load(q_row + offs_v[None, :], mask=row_ok[:, None], other=0.0)
    q_rope = tl.load(q_row + D_V + offs_r[None, :], mask=row_ok[:, None], other=0.0)

    # This split's key range, in whole KV tiles.
    chunk = tl.cdiv(tl.cdiv(kv_len, num_splits), BLOCK_N) * BLOCK_N
    k_start = split * chunk
    k_end = tl.minimum(k_start + chunk, kv_len)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_V], tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    for k0 in range(k_start, k_end, BLOCK_N):
        keys = k0 + offs_n
        key_ok = keys < k_end
        page = tl.load(block_table_ptr + b * stride_btb + keys // page_size, mask=key_ok, other=0)
        kv_row = kv_ptr + page.to(tl.int64)[:, None] * stride_kvp + (keys % page_size)[:, None] * stride_kvs
        k_nope = tl.load(kv_row + offs_v[None, :], mask=key_ok[:, None], other=0.0)
        k_rope = tl.load(kv_row + D_V + offs_r[None, :], mask=key_ok[:, None], other=0.0)
        s = _dot(q_nope, tl.trans(k_nope), tl.zeros([BLOCK_M, BLOCK_N], tl.float32), DOT_F32)
        s = _dot(q_rope, tl.trans(k_rope), s, DOT_F32) * qk_scale  # log2 domain
        allowed = key_ok[None, :] & row_ok[:, None]
        if k0 + BLOCK_N > prefix:  # the tile reaches the tree slots: apply the ancestor mask
            j = keys - prefix
            in_tree = (j >= 0)[None, :]
            word = tl.load(
                vis_ptr + b * stride_visb + node[:, None] * stride_visn + (j >> 6)[None, :],
                mask=in_tree & allowed, other=0,
            )
            seen = ((word >> (j & 63)[None, :]) & 1) != 0
            allowed = allowed & (~in_tree | seen)
        s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing seen yet
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = _dot(p.to(k_nope.dtype), k_nope, acc * alpha[:, None], DOT_F32)
        m_i = m_new

    has_keys = l_i > 0.0
    out = tl.where(has_keys[:, None], acc / tl.where(has_keys, l_i, 1.0)[:, None], 0.0)
    lse = tl.where(has_keys, (m_i + tl.log2(tl.where(has_keys, l_i, 1.0))) / 1.4426950408889634, float("-inf"))
    in_req = rows < rows_per_req
    o_row = out_ptr + b * stride_ob + node[:, None] * stride_on + head[:, None] * stride_oh + split * stride_os
    tl.store(o_row + offs_v[None, :], out.to(out_ptr.dtype.element_ty), mask=in_req[:, None])
    l_ptrs = lse_ptr + b * stride_lb + node * stride_ln + head * stride_lh + split * stride_ls
    tl.store(l_ptrs, lse, mask=in_req)


@triton.jit
def merge_splits_kernel(
    part_ptr, part_lse_ptr, out_ptr, lse_ptr, num_splits,
    D_V: tl.constexpr, SPLITS: tl.constexpr, BLOCK_V: tl.constexpr, PDL: tl.constexpr,
):
    # One program per (b, n, h) row and BLOCK_V of its D_V values (a decode step has 16 rows: more
    # programs each load less of the partials); partials [rows, splits, D_V] float32, contiguous.
    wait_for_producers(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs_v = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    offs_s = tl.arange(0, SPLITS)
    s_ok = offs_s < num_splits
    lse_s = tl.load(part_lse_ptr + row * num_splits + offs_s, mask=s_ok, other=float("-inf"))
    m = tl.max(lse_s, 0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp(lse_s - m_safe)
    total = tl.sum(w, 0)
    part = tl.load(part_ptr + (row * num_splits + offs_s[:, None]) * D_V + offs_v[None, :], mask=s_ok[:, None], other=0.0)
    merged = tl.sum(part * w[:, None], 0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + row * D_V + offs_v, merged.to(out_ptr.dtype.element_ty))
    if tl.program_id(1) == 0:
        tl.store(lse_ptr + row, tl.where(total > 0, m_safe + tl.log(total), float("-inf")))
