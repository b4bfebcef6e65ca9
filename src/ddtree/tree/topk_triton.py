"""Top-k of the drafter's logits in two Triton launches: no torch.topk or torch.sort, no
data-dependent size.

Every logit becomes the unique int64 key of topk.sort_keys (its float32 bits mapped to an ordered
integer, high; V - 1 - token, low), so the largest keys are exactly the reference's tokens in the
reference's order, ties included. Rows are cut into chunks so that even one row fills the GPU.
The first launch writes, per chunk, its log-sum-exp terms (max, sum of exp) and CAP = 4 KPAD
slots holding a superset of its KPAD largest keys: the chunk's logits at least the KPAD-th largest
of its 4 KPAD group maxima (counted pairwise up to RANK_GROUPS groups, fewer instructions than a
sort there; a few candidates per group on drafter logits; where more, as when many logits tie,
the chunk's own KPAD best from Triton's bitonic tl.topk), the other slots padding. The second
keeps each row's KPAD best of its chunks' slots (tl.topk in groups), decodes the logit and token
from each key and subtracts the row's log-sum-exp.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..ops.launch import launch_flags, wait_for_producers

LOG2E: tl.constexpr = tl.constexpr(1.4426950408889634)  # 1 / ln 2
LN2: tl.constexpr = tl.constexpr(0.6931471805599453)
NO_KEY: tl.constexpr = tl.constexpr(-(2**63))  # below every logit's key (padding)
FLIP: tl.constexpr = tl.constexpr(0x7FFFFFFF)  # flips every bit but the sign of a float32's pattern
CHUNK = 4096  # logits per program of the first launch
MERGE = 4096  # keys per tl.topk of the second launch
MAX_K = 256  # larger k: the reference path (topk.py)
CANDIDATES = 4  # per chunk, 4 k groups and room for 4 k candidates
RANK_GROUPS: tl.constexpr = tl.constexpr(128)  # up to this many groups, their k-th maximum by counting, not tl.topk


@triton.jit
def _chunk_kernel(
    x_ptr, keys_ptr, m_ptr, s_ptr, stride_xr, vocab, chunks,
    CHUNK: tl.constexpr, GROUPS: tl.constexpr, KPAD: tl.constexpr, CAP: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_producers(PDL)
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    width: tl.constexpr = CHUNK // GROUPS
    ids = chunk * CHUNK + tl.arange(0, GROUPS)[:, None] * width + tl.arange(0, width)[None, :]  # [GROUPS, width]
    inside = ids < vocab
    # float32 is exact for fp16 / bf16 / fp32 (the interpreter keeps bf16 as raw bits until here);
    # + 0.0 folds -0.0 into +0.0, which compare equal
    x = tl.load(x_ptr + row * stride_xr + ids, mask=inside, other=float("-inf")).to(tl.float32) + 0.0
    bits = x.to(tl.int32, bitcast=True)
    ordered = tl.where(bits < 0, bits ^ FLIP, bits).to(tl.int64)
    keys = tl.where(inside, (ordered << 32) | (vocab - 1 - ids).to(tl.int64), NO_KEY)
    out = row * chunks + chunk
    slots = keys_ptr + out * CAP + tl.arange(0, CAP)
    # KPAD groups have a maximum >= the KPAD-th largest group maximum, so the chunk's KPAD best are
    # at least that: only those candidates need sorting (a few per group on drafter logits)
    group_max = tl.max(tl.where(x != x, float("-inf"), x), 1)
    if GROUPS <= RANK_GROUPS:  # the least maximum with fewer than KPAD above it: no sort
        above = tl.sum((group_max[None, :] > group_max[:, None]).to(tl.int32), 1)
        least = tl.min(tl.where(above < KPAD, group_max, float("inf")), 0)
    else:
        least = tl.min(tl.topk(group_max, KPAD), 0)
    pick = inside & ((x >= least) | (x != x))  # NaN sorts first, as in the reference
    count = tl.sum(tl.sum(pick.to(tl.int32), 1), 0)
    if count <= CAP:
        per_group = tl.sum(pick.to(tl.int32), 1)
        at = tl.cumsum(per_group, 0) - per_group
        at = at[:, None] + tl.cumsum(pick.to(tl.int32), 1) - 1  # distinct slots < count
        tl.store(keys_ptr + out * CAP + at, keys, mask=pick)
        tl.store(slots, tl.full([CAP], NO_KEY, tl.int64), mask=tl.arange(0, CAP) >= count)
    else:  # ties or a flat chunk: sort all of it
        tl.store(keys_ptr + out * CAP + tl.arange(0, KPAD), tl.topk(tl.reshape(keys, [CHUNK]), KPAD))
        tl.store(slots, tl.full([CAP], NO_KEY, tl.int64), mask=tl.arange(0, CAP) >= KPAD)
    m = tl.max(tl.max(x, 1), 0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)  # an all -inf chunk adds 0, not NaN
    tl.store(m_ptr + out, m)
    tl.store(s_ptr + out, tl.sum(tl.sum(tl.exp2((x - m_safe) * LOG2E), 1), 0))


@triton.jit
def _merge_kernel(
    keys_ptr, m_ptr, s_ptr, lp_ptr, tok_ptr, vocab, chunks, k,
    KPAD: tl.constexpr, CAP: tl.constexpr, GROUP: tl.constexpr, CPAD: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_producers(PDL)
    row = tl.program_id(0).to(tl.int64)
    base = keys_ptr + row * chunks * CAP
    best = tl.full([KPAD], NO_KEY, tl.int64)
    for first in range(0, chunks, GROUP):  # GROUP chunks' candidates (GROUP * CAP keys) per tl.topk
        c = first + tl.arange(0, GROUP)
        group = tl.load(base + c[:, None] * CAP + tl.arange(0, CAP)[None, :], mask=(c < chunks)[:, None], other=NO_KEY)
        best = tl.topk(tl.reshape(tl.join(best, tl.topk(tl.reshape(group, [GROUP * CAP]), KPAD)), [2 * KPAD]), KPAD)
    c = tl.arange(0, CPAD)
    m = tl.load(m_ptr + row * chunks + c, mask=c < chunks, other=float("-inf"))
    s = tl.load(s_ptr + row * chunks + c, mask=c < chunks, other=0.0)
    top = tl.max(m, 0)
    top_safe = tl.where(top == float("-inf"), 0.0, top)
    lse = top_safe + tl.log2(tl.sum(s * tl.exp2((m - top_safe) * LOG2E), 0)) * LN2
    lse = tl.where(top == float("inf"), top, lse)  # as logsumexp: +inf, whatever the chunks' sums
    ordered = (best >> 32).to(tl.int32)
    logit = tl.where(ordered < 0, ordered ^ FLIP, ordered).to(tl.float32, bitcast=True)
    token = vocab - 1 - (best & 0xFFFFFFFF)
    j = tl.arange(0, KPAD)
    tl.store(lp_ptr + row * k + j, logit - lse, mask=j < k)
    tl.store(tok_ptr + row * k + j, token, mask=j < k)


def topk_logprobs_triton(logits: torch.Tensor, k: int, *, chunk: int = CHUNK, pdl: bool = True
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [B, D, V] (fp16 / bf16 / fp32, validated by the caller; k <= MAX_K) -> (logprobs
    float32 [B, D, k], tokens int64 [B, D, k]); the same tokens in the same order as
    topk.topk_logprobs_reference, log-probs to float32 rounding of the normalizer. `chunk` (a
    power of two, at least k's) bounds the logits per program of the first launch."""
    b, d, vocab = logits.shape
    kpad = max(2, triton.next_power_of_2(k))  # tl.topk of 1 fails
    if k > MAX_K or chunk < kpad or chunk & (chunk - 1):
        raise ValueError(f"topk_logprobs_triton takes k <= {MAX_K} and a power-of-two chunk >= k, got k={k}, chunk={chunk}")
    chunk = max(kpad, min(chunk, triton.next_power_of_2(vocab)))  # a small vocabulary: no padding chunk
    rows = logits.reshape(b * d, vocab)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    n_rows, chunks, dev = b * d, triton.cdiv(vocab, chunk), logits.device
    lp = torch.empty(n_rows, k, dtype=torch.float32, device=dev)
    tok = torch.empty(n_rows, k, dtype=torch.int64, device=dev)
    if n_rows == 0:
        return lp.view(b, d, k), tok.view(b, d, k)
    cap = CANDIDATES * kpad
    keys = torch.empty(n_rows, chunks, cap, dtype=torch.int64, device=dev)
    m = torch.empty(n_rows, chunks, dtype=torch.float32, device=dev)
    s = torch.empty_like(m)
    flags = launch_flags(dev, pdl)
    _chunk_kernel[(n_rows, chunks)](rows, keys, m, s, rows.stride(0), vocab, chunks,
                                    CHUNK=chunk, GROUPS=min(chunk, CANDIDATES * kpad), KPAD=kpad, CAP=cap,
                                    num_warps=8, **flags)
    group = min(triton.next_power_of_2(chunks), max(1, MERGE // cap))
    _merge_kernel[(n_rows,)](keys, m, s, lp, tok, vocab, chunks, k, KPAD=kpad, CAP=cap, GROUP=group,
                             CPAD=triton.next_power_of_2(chunks), num_warps=8, **flags)
    return lp.view(b, d, k), tok.view(b, d, k)
