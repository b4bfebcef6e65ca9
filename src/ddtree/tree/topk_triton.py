"""Top-k with a deterministic tie order on the GPU: torch.topk's values, then two Triton passes.

torch.topk picks the right values but, among equal values at the boundary, arbitrary indices.
Given its k-th value t per row, the selected set is fixed: every token with logit > t, then the
smallest-id tokens with logit == t until k are taken. Rows are cut into chunks so that even one
row fills the GPU: a first pass counts, per chunk, the logits > t and == t and the chunk's
log-sum-exp; exclusive prefix sums over chunks then say where each chunk's picks go, and a second
pass (which skips chunks holding no candidate, i.e. nearly all) writes the picked token ids in
token order. A stable sort by logit finishes the order.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

LOG2E: tl.constexpr = tl.constexpr(1.4426950408889634)  # 1 / ln 2
CHUNK = 4096  # logits per program


@triton.jit
def _count_kernel(
    x_ptr, thresh_ptr, n_gt_ptr, n_eq_ptr, m_ptr, s_ptr,
    stride_xr, stride_tr, vocab, chunks,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    ids = chunk * BLOCK + tl.arange(0, BLOCK)
    inside = ids < vocab
    # Compare in float32 (exact for fp16 / bf16 / fp32; the interpreter keeps bf16 as raw bits).
    x = tl.where(inside, tl.load(x_ptr + row * stride_xr + ids, mask=inside, other=0).to(tl.float32), float("-inf"))
    t = tl.load(thresh_ptr + row * stride_tr).to(tl.float32)
    out = row * chunks + chunk
    tl.store(n_gt_ptr + out, tl.sum((x > t).to(tl.int32), 0))
    tl.store(n_eq_ptr + out, tl.sum(((x == t) & inside).to(tl.int32), 0))
    m = tl.max(x, 0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)  # an all -inf chunk adds 0, not NaN
    tl.store(m_ptr + out, m)
    tl.store(s_ptr + out, tl.sum(tl.exp2((x - m_safe) * LOG2E), 0))


@triton.jit
def _write_kernel(
    x_ptr, thresh_ptr, need_ptr, n_gt_ptr, n_eq_ptr, gt_before_ptr, eq_before_ptr, out_idx_ptr,
    stride_xr, stride_tr, vocab, chunks, k,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    at = row * chunks + chunk
    need = tl.load(need_ptr + row)  # how many tokens equal to t the row takes
    eq_before = tl.load(eq_before_ptr + at)
    n_eq = tl.where(eq_before < need, tl.load(n_eq_ptr + at), 0)  # equals past `need` are not taken
    if tl.load(n_gt_ptr + at) + n_eq > 0:  # nearly every chunk holds no candidate: skip it
        ids = chunk * BLOCK + tl.arange(0, BLOCK)
        inside = ids < vocab
        x = tl.where(inside, tl.load(x_ptr + row * stride_xr + ids, mask=inside, other=0).to(tl.float32), float("-inf"))
        t = tl.load(thresh_ptr + row * stride_tr).to(tl.float32)
        equal = (x == t) & inside
        pick = (x > t) | (equal & (eq_before + tl.cumsum(equal.to(tl.int32), 0) <= need))
        before = tl.load(gt_before_ptr + at) + tl.minimum(eq_before, need)  # picks in earlier chunks
        pos = before + tl.cumsum(pick.to(tl.int32), 0) - 1
        tl.store(out_idx_ptr + row * k + pos, ids.to(tl.int64), mask=pick)


def topk_logprobs_triton(logits: torch.Tensor, k: int, *, chunk: int = CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [B, D, V] (fp16 / bf16 / fp32, validated by the caller) -> (logprobs float32
    [B, D, k], tokens int64 [B, D, k]); the same contract as topk.topk_logprobs_reference.
    `chunk` (a power of two) is the logits per program."""
    b, d, vocab = logits.shape
    rows = logits.reshape(b * d, vocab)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    n_rows, chunks, dev = b * d, triton.cdiv(vocab, chunk), logits.device
    values = torch.topk(rows, k, dim=-1, sorted=True).values
    thresh = values[:, k - 1 :]
    need = k - (values > thresh).sum(-1, dtype=torch.int32)
    n_gt = torch.empty(n_rows, chunks, dtype=torch.int32, device=dev)
    n_eq = torch.empty_like(n_gt)
    m = torch.empty(n_rows, chunks, dtype=torch.float32, device=dev)
    s = torch.empty_like(m)
    idx = torch.empty((n_rows, k), dtype=torch.int64, device=dev)
    if n_rows == 0:
        return idx.float().view(b, d, k), idx.view(b, d, k)
    grid = (n_rows, chunks)
    _count_kernel[grid](rows, thresh, n_gt, n_eq, m, s, rows.stride(0), thresh.stride(0), vocab, chunks,
                        BLOCK=chunk, num_warps=8)
    gt_before = (n_gt.cumsum(-1, dtype=torch.int32) - n_gt).contiguous()
    eq_before = (n_eq.cumsum(-1, dtype=torch.int32) - n_eq).contiguous()
    _write_kernel[grid](rows, thresh, need, n_gt, n_eq, gt_before, eq_before, idx,
                        rows.stride(0), thresh.stride(0), vocab, chunks, k, BLOCK=chunk, num_warps=8)
    m_row = m.max(-1, keepdim=True).values
    lse = m_row + torch.log((s * torch.exp(m - m_row)).sum(-1, keepdim=True))
    picked = rows.gather(-1, idx)
    order = torch.sort(picked, dim=-1, descending=True, stable=True).indices
    tokens = idx.gather(-1, order)
    logprobs = picked.gather(-1, order).float() - lse
    return logprobs.view(b, d, k), tokens.view(b, d, k)
