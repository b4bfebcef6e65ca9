"""Top-k with a deterministic tie order on the GPU: torch.topk's values, then one Triton pass.

torch.topk picks the right values but, among equal values at the boundary, arbitrary indices.
Given its k-th value t per row, the selected set is fixed: every token with logit > t, then the
smallest-id tokens with logit == t until k are taken. One pass over the row writes that set in
token order (and the row's log-sum-exp on the way); a stable sort by logit finishes the order.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

LOG2E: tl.constexpr = tl.constexpr(1.4426950408889634)  # 1 / ln 2


@triton.jit
def _select_kernel(
    x_ptr, thresh_ptr, need_ptr, out_idx_ptr, out_lse_ptr,
    stride_xr, stride_tr, vocab, k,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_xr
    t = tl.load(thresh_ptr + row * stride_tr).to(tl.float32)  # exact for fp16 / bf16 / fp32
    need = tl.load(need_ptr + row)  # how many tokens equal to t to take
    offs = tl.arange(0, BLOCK)
    taken = tl.zeros([], tl.int32)
    equal_seen = tl.zeros([], tl.int32)
    m = tl.full([], float("-inf"), tl.float32)
    s = tl.zeros([], tl.float32)
    for start in range(0, vocab, BLOCK):
        ids = start + offs
        inside = ids < vocab
        x = tl.where(inside, tl.load(x_row + ids, mask=inside, other=0).to(tl.float32), float("-inf"))
        if tl.sum((x >= t).to(tl.int32), 0) > 0:  # most blocks hold no candidate: skip the scans
            equal = (x == t) & inside
            equal_rank = equal_seen + tl.cumsum(equal.to(tl.int32), 0)  # 1-based among equals
            pick = (x > t) | (equal & (equal_rank <= need))
            pos = taken + tl.cumsum(pick.to(tl.int32), 0) - 1
            tl.store(out_idx_ptr + row * k + pos, ids.to(tl.int64), mask=pick)
            taken += tl.sum(pick.to(tl.int32), 0)
            equal_seen += tl.sum(equal.to(tl.int32), 0)
        # Online log-sum-exp in float32 (base 2 for exp2).
        m_new = tl.maximum(m, tl.max(x, 0))
        s = s * tl.exp2((m - m_new) * LOG2E) + tl.sum(tl.exp2((x - m_new) * LOG2E), 0)
        m = m_new
    tl.store(out_lse_ptr + row, m + tl.log2(s) / LOG2E)


def topk_logprobs_triton(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [B, D, V] (fp16 / bf16 / fp32, validated by the caller) -> (logprobs float32
    [B, D, k], tokens int64 [B, D, k]); the same contract as topk.topk_logprobs_reference."""
    b, d, vocab = logits.shape
    rows = logits.reshape(b * d, vocab)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    values = torch.topk(rows, k, dim=-1, sorted=True).values
    thresh = values[:, k - 1 :]
    need = k - (values > thresh).sum(-1, dtype=torch.int32)
    idx = torch.empty((b * d, k), dtype=torch.int64, device=logits.device)
    lse = torch.empty((b * d,), dtype=torch.float32, device=logits.device)
    if b * d > 0:
        _select_kernel[(b * d,)](
            rows, thresh, need, idx, lse,
            rows.stride(0), thresh.stride(0), vocab, k,
            BLOCK=2048, num_warps=8,
        )
    picked = rows.gather(-1, idx)
    order = torch.sort(picked, dim=-1, descending=True, stable=True).indices
    tokens = idx.gather(-1, order)
    logprobs = picked.gather(-1, order).float() - lse[:, None]
    return logprobs.view(b, d, k), tokens.view(b, d, k)
