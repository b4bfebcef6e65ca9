"""Batched draft-tree builder in Triton: one program per request, one launch per batch.

The best-first heap of reference.py lives in registers as CAP candidate slots. Each step pops the
best slot with a single tuple reduction and writes back at most two candidates (the popped node's
next sibling and first child). The heap key's tie-break, the lexicographic order of rank paths,
is kept as an integer `ord` per candidate: a popped candidate's first child takes its place in
that order and its next sibling comes right after (no other live candidate can sit between them),
so ords stay exact with one vector shift per step.

Per-slot state (CAP = next_pow2(budget) slots):
    w      float64  the candidate's log-weight; -inf marks an empty slot
    base   float64  w - own log-prob, so the next sibling's weight is base + next (the reference's
                    `w - lp[r] + lp[r + 1]`, rounded in the same order)
    info   int64    ord << 38 | slot << 27 | parent << 16 | rank << 6 | depth
    lps    int64    bits(next sibling's log-prob) << 32 | bits(first child's log-prob)
The log-probs a new candidate will need later are loaded when it is pushed and merged into `lps`
one step late, so their load latency hides behind the next reduction.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .types import PAD, DraftTrees, empty_trees, visibility_words

_PAD: tl.constexpr = tl.constexpr(PAD)


@triton.jit
def _pick_best(w1, info1, lps1, base1, w2, info2, lps2, base2):
    # Max weight; equal weights by smaller ord (info's top bits): the reference's heap order.
    take1 = (w1 > w2) | ((w1 == w2) & (info1 < info2))
    return (
        tl.where(take1, w1, w2),
        tl.where(take1, info1, info2),
        tl.where(take1, lps1, lps2),
        tl.where(take1, base1, base2),
    )


@triton.jit
def _pack_info(ordv, slot, parent, rank, depth):
    return (
        (tl.cast(ordv, tl.int64) << 38)
        | (tl.cast(slot, tl.int64) << 27)
        | (tl.cast(parent, tl.int64) << 16)
        | (tl.cast(rank, tl.int64) << 6)
        | tl.cast(depth, tl.int64)
    )


@triton.jit
def _pack_lps(next_lp, child_lp):
    hi = next_lp.to(tl.int32, bitcast=True).to(tl.int64) << 32
    lo = child_lp.to(tl.uint32, bitcast=True).to(tl.int64)  # zero-extended
    return hi | lo


@triton.jit
def _build_tree_kernel(
    lp_ptr, tok_ptr,
    out_tokens, out_parents, out_depths, out_num_nodes, out_vis,
    stride_lb, stride_ld, stride_lk,
    stride_tb, stride_td, stride_tk,
    budget, k_used, depth_max, num_words,
    CAP: tl.constexpr, ROWS: tl.constexpr, W_PAD: tl.constexpr,
):
    NEG_INF: tl.constexpr = float("-inf")
    b = tl.program_id(0).to(tl.int64)
    lp_row = lp_ptr + b * stride_lb
    offs = tl.arange(0, CAP)

    # The root's first child seeds the heap (unless its probability is 0).
    lp00 = tl.load(lp_row)
    w0 = lp00.to(tl.float64)
    next0 = tl.load(lp_row + stride_lk, mask=k_used > 1, other=NEG_INF)
    child0 = tl.load(lp_row + stride_ld, mask=depth_max > 1, other=NEG_INF)
    # Masks are built as `offs == where(cond, index, -1)`: one compare per slot (and the
    # interpreter mistypes a scalar condition broadcast into `vector & scalar`).
    at0 = offs == 0
    zero = tl.zeros([CAP], tl.int64)
    w_vec = tl.where(offs == tl.where(lp00 > NEG_INF, 0, -1), w0, tl.full([CAP], NEG_INF, tl.float64))
    base_vec = tl.where(at0, w0 - lp00.to(tl.float64), tl.zeros([CAP], tl.float64))
    info_vec = tl.where(at0, 1, zero)  # ord 0, slot 0, parent 0 (root), rank 0, depth 1
    lps_vec = tl.where(at0, _pack_lps(next0, child0), zero)

    node_info = tl.zeros([CAP], tl.int64)  # info of node i + 1 when popped (depth, rank, parent bits)
    n_nodes = tl.zeros([], tl.int64)
    n_slots = tl.full([], 1, tl.int64)
    # Loads for the candidates pushed last step (f: first child, s: next sibling), merged late.
    pf_slot = tl.full([], -1, tl.int64)
    pf_next = tl.full([], NEG_INF, tl.float32)
    pf_child = tl.full([], NEG_INF, tl.float32)
    ps_slot = tl.full([], -1, tl.int64)
    ps_next = tl.full([], NEG_INF, tl.float32)
    ps_child = tl.full([], NEG_INF, tl.float32)

    for step in range(budget):
        w, info, lps, base = tl.reduce((w_vec, info_vec, lps_vec, base_vec), 0, _pick_best)
        alive = w > NEG_INF
        slot = (info >> 27) & 0x7FF
        pf_lps = _pack_lps(pf_next, pf_child)
        ps_lps = _pack_lps(ps_next, ps_child)
        lps = tl.where(slot == pf_slot, pf_lps, tl.where(slot == ps_slot, ps_lps, lps))
        lps_vec = tl.where(offs == pf_slot, pf_lps, tl.where(offs == ps_slot, ps_lps, lps_vec))

        depth = info & 0x3F
        rank = (info >> 6) & 0x3FF
        parent = (info >> 16) & 0x7FF
        ordv = info >> 38
        next_lp = (lps >> 32).to(tl.int32).to(tl.float32, bitcast=True)
        child_lp = lps.to(tl.int32).to(tl.float32, bitcast=True)  # truncation keeps the low word

        # Record node `step + 1`.
        node_info = tl.where(offs == tl.where(alive, step, -1), info, node_info)
        n_nodes += alive.to(tl.int64)

        # Successors: the first child takes the popped slot and its order, the next sibling
        # follows it (in the popped slot if there is no child, else in a new slot); the other
        # live candidates after it in path order shift by the net count.
        has_child = alive & (child_lp > NEG_INF)
        has_sib = alive & (next_lp > NEG_INF)
        both = has_child & has_sib
        w_f = w + child_lp.to(tl.float64)
        base_f = w_f - child_lp.to(tl.float64)
        w_s = base + next_lp.to(tl.float64)
        base_s = w_s - next_lp.to(tl.float64)
        slot_s = tl.where(has_child, n_slots, slot)
        n_slots += both.to(tl.int64)
        info_f = _pack_info(ordv, slot, step + 1, 0, depth + 1)
        info_s = _pack_info(ordv + has_child.to(tl.int64), slot_s, parent, rank + 1, depth)
        shift = has_child.to(tl.int64) + has_sib.to(tl.int64) - 1
        later = (info_vec >> 38) > tl.where(alive, ordv, 1 << 20)
        info_vec = tl.where(later, info_vec + (shift << 38), info_vec)

        at_slot = offs == tl.where(alive, slot, -1)
        w_vec = tl.where(at_slot, tl.where(has_child, w_f, tl.where(has_sib, w_s, NEG_INF)), w_vec)
        base_vec = tl.where(at_slot, tl.where(has_child, base_f, base_s), base_vec)
        info_vec = tl.where(at_slot, tl.where(has_child, info_f, info_s), info_vec)
        at_new = offs == tl.where(both, slot_s, -1)
        w_vec = tl.where(at_new, w_s, w_vec)
        base_vec = tl.where(at_new, base_s, base_vec)
        info_vec = tl.where(at_new, info_s, info_vec)

        # Issue the loads the new candidates need once they are popped.
        pf_slot = tl.where(has_child, slot, -1)
        pf_next = tl.load(lp_row + depth * stride_ld + stride_lk, mask=has_child & (k_used > 1), other=NEG_INF)
        pf_child = tl.load(lp_row + (depth + 1) * stride_ld, mask=has_child & (depth + 1 < depth_max), other=NEG_INF)
        ps_slot = tl.where(has_sib, slot_s, -1)
        ps_next = tl.load(
            lp_row + (depth - 1) * stride_ld + (rank + 2) * stride_lk, mask=has_sib & (rank + 2 < k_used), other=NEG_INF
        )
        ps_child = child_lp

    # Per-node outputs: tokens gathered once at the end, PAD past num_nodes.
    valid = offs < n_nodes
    node_depth = tl.where(valid, node_info & 0x3F, _PAD)
    node_rank = (node_info >> 6) & 0x3FF
    node_parent = tl.where(valid, (node_info >> 16) & 0x7FF, _PAD)
    in_budget = offs < budget
    tok = tl.load(
        tok_ptr + b * stride_tb + (node_depth - 1) * stride_td + node_rank * stride_tk, mask=valid, other=_PAD
    )
    row_out = b * budget + offs
    tl.store(out_tokens + row_out, tl.where(valid, tok, _PAD), mask=in_budget)
    tl.store(out_parents + row_out, node_parent, mask=in_budget)
    tl.store(out_depths + row_out, node_depth, mask=in_budget)
    tl.store(out_num_nodes + b, n_nodes)

    # Visibility rows: walk each row's ancestors, root included (tree depth + 1 of them), reading
    # parents from registers (a warp shuffle / shared-memory gather, not a global round trip).
    levels = tl.maximum(tl.max(node_depth), 0) + 1
    word_ids = tl.arange(0, W_PAD)
    one = tl.full([ROWS], 1, tl.int64)
    for row0 in range(0, budget + 1, ROWS):
        rows = row0 + tl.arange(0, ROWS)
        anc = tl.where(rows <= n_nodes, rows, -1).to(tl.int64)
        words = tl.zeros([ROWS, W_PAD], tl.int64)
        for _ in range(levels):
            hit = (anc[:, None] >= 0) & ((anc[:, None] >> 6) == word_ids[None, :])
            words |= tl.where(hit, (one << (anc & 63))[:, None], 0)
            up = anc > 0
            anc = tl.where(up, tl.gather(node_parent, tl.where(up, anc - 1, 0).to(tl.int32), 0), -1)
        vis_ptr = out_vis + (b * (budget + 1) + rows[:, None]) * num_words + word_ids[None, :]
        tl.store(vis_ptr, words, mask=(rows[:, None] <= budget) & (word_ids[None, :] < num_words))


def default_num_warps(cap: int) -> int:
    """Warps per program: one warp keeps the per-step reduction in shuffles; wide heaps need more
    threads so the per-slot state stays in registers."""
    return max(1, min(8, cap // 128))


def build_trees_triton(
    top_logprobs: torch.Tensor,
    top_tokens: torch.Tensor,
    budget: int,
    *,
    out: DraftTrees | None = None,
    num_warps: int | None = None,
) -> DraftTrees:
    """Triton builder. Same contract as reference.build_trees_reference; inputs already validated.

    top_logprobs float32 [B, D, K], top_tokens int64 [B, D, K] (any strides). `out`, if given
    (checked by the caller), receives the trees in place. Output sizes depend only on
    (B, budget, D), so the launch is CUDA-graph capturable and never syncs with the host.
    """
    b, depth_max, k = top_logprobs.shape
    out = out or empty_trees(b, budget, depth_max, top_logprobs.device)
    words = visibility_words(budget)
    cap = triton.next_power_of_2(budget)
    w_pad = triton.next_power_of_2(words)
    rows = max(1, min(triton.next_power_of_2(budget + 1), 2048 // w_pad))
    if b > 0:
        _build_tree_kernel[(b,)](
            top_logprobs, top_tokens,
            out.tokens, out.parents, out.depths, out.num_nodes, out.visibility,
            *top_logprobs.stride(), *top_tokens.stride(),
            budget, min(k, budget), depth_max, words,
            CAP=cap, ROWS=rows, W_PAD=w_pad,
            num_warps=num_warps or default_num_warps(cap),
        )
    return out
