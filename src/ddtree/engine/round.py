"""One round for the first `bucket` slots of the batch: draft, top-k, build, verify, accept, commit.

Written for capture: shapes depend only on the plan's (bucket, budget, k), nothing reads a value
back to the host, and the result is one small int64 tensor the host copies once. Budget 0 is the
autoregressive step (one row per request, no drafter).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..models.paged import ForwardMeta
from ..tree import accept_paths, build_trees, topk_logprobs
from .batch import BatchState
from .commit import commit
from .sampling import choose_tokens
from .timing import StageTimer


@dataclass(frozen=True)
class RoundPlan:
    """The static shape and switches of one round (all host values).

    bucket: slots 0 .. bucket - 1 take part; budget: tree nodes per request in this round's
    shapes (0: the autoregressive step); k: top-k ranks per depth (min(budget, vocab), 1 for a
    chain-only batch); any_sampled / any_filtered: some slot samples / cuts by top-k or top-p;
    key_limit: bound on the drafter's context + block length; features: feed the drafter the
    committed rows' hidden states (a plain step sets them aside in BatchState.pending_features);
    flush: append the set-aside rows to the drafter's context (a plain step: after setting its
    own aside; a tree round: before drafting); experts: count the routed experts each request's
    rows touched; paths: a tree round also reports each request's accepted node numbers (what
    budget="auto" learns from, engine/acceptance.py).
    """

    bucket: int
    budget: int
    k: int
    any_sampled: bool
    any_filtered: bool
    key_limit: int | None
    features: bool
    experts: bool
    paths: bool = False
    flush: bool = False


@dataclass
class RoundContext:
    """What a round needs besides the batch state: the models and the cache geometry."""

    target: object
    drafter: object | None
    caches: list[torch.Tensor]
    page_size: int
    scratch_page: int
    feature_layers: tuple[int, ...]
    num_experts: int


def result_width(max_depth: int, moe_layers: int, paths: bool = False) -> int:
    """Columns of a round's result: accept_len, D + 1 committed tokens, one count per MoE layer
    (when the plan counts experts), then for a tree round with paths: the D + 1 accepted node
    numbers (root (0) first, -1 after)."""
    return 1 + max_depth + 1 + moe_layers + (max_depth + 1 if paths else 0)


def experts_touched(router_ids: list[torch.Tensor], valid_rows: torch.Tensor, num_experts: int) -> torch.Tensor:
    """int64 [B, layers]: distinct routed experts the valid rows [B, N] of each request touched,
    from each MoE layer's ids [B * N, k]. All layers at once: a handful of launches per round,
    not four per MoE layer (104 small kernels in a Moonlight round)."""
    b, n = valid_rows.shape
    if not router_ids:
        return torch.zeros(b, 0, dtype=torch.int64, device=valid_rows.device)
    ids = torch.stack(router_ids)  # [layers, B * N, k]
    layers, k = ids.shape[0], ids.shape[2]
    ids = torch.where(valid_rows[None, :, :, None], ids.view(layers, b, n, k), num_experts).view(layers, b, n * k)
    hit = torch.zeros(layers, b, num_experts + 1, dtype=torch.bool, device=ids.device).scatter_(2, ids, True)
    return hit[..., :num_experts].sum(2).transpose(0, 1)


def _verify(ctx: RoundContext, state: BatchState, plan: RoundPlan, ids, positions, num_rows, visibility):
    """Target forward of the round's rows; returns logits, hidden features, expert counts."""
    bucket = plan.bucket
    meta = ForwardMeta.build(state.block_table[:bucket], state.prefix_lens[:bucket], num_rows, positions, visibility,
                             page_size=ctx.page_size, scratch_page=ctx.scratch_page)
    router_ids = [] if plan.experts else None
    logits, hidden = ctx.target.forward_paged(ids, meta, ctx.caches, ctx.feature_layers if plan.features else (),
                                              router_ids=router_ids)
    valid = torch.arange(ids.shape[1], device=ids.device)[None, :] < num_rows.long()[:, None]
    touched = experts_touched(router_ids, valid, ctx.num_experts) if plan.experts else None
    return logits, hidden, touched


def _choose(state: BatchState, plan: RoundPlan, logits, positions):
    s = slice(0, plan.bucket)
    return choose_tokens(logits, positions + 1, state.temperature[s], state.top_k[s], state.top_p[s], state.seed[s],
                         any_sampled=plan.any_sampled, any_filtered=plan.any_filtered)


def run_round(ctx: RoundContext, state: BatchState, plan: RoundPlan, max_depth: int, timer: StageTimer) -> torch.Tensor:
    """Advance slots 0 .. bucket - 1 by one round, in place; returns int64 [bucket, result_width]:
    column 0 accept_len (tokens committed: accepted nodes + the bonus; 0 for inactive slots),
    columns 1 .. D + 1 the committed tokens (-1 past accept_len), then the expert counts, then
    (tree rounds with plan.paths) the accepted node numbers (result_width).
    A slot takes part when it is active and has tokens remaining (BatchState.remaining)."""
    if plan.budget == 0:
        return _ar_step(ctx, state, plan, max_depth, timer)
    return _tree_round(ctx, state, plan, max_depth, timer)


def _ar_step(ctx, state, plan, max_depth, timer):
    s = slice(0, plan.bucket)
    active = state.taking_part(plan.bucket)
    ids = state.bonus[s, None]
    positions = state.prefix_lens[s].long()[:, None]
    num_rows = active.int()
    visibility = torch.ones(plan.bucket, 1, 1, dtype=torch.int64, device=ids.device)
    logits, hidden, touched = _verify(ctx, state, plan, ids, positions, num_rows, visibility)
    timer.mark("verify")
    chosen = _choose(state, plan, logits, positions)[:, 0]
    timer.mark("accept")
    accept_len = active.long()
    state.prefix_lens[s] += num_rows  # first: a flush places the set-aside rows by it
    if plan.features:  # the drafter's context takes this row at the next flush, with others at once
        s_rows = torch.arange(plan.bucket, device=ids.device)
        pending = state.pending_rows[s]
        state.pending_features[s_rows, pending.clamp_max(state.pending_features.shape[1] - 1)] = torch.cat(hidden, -1)[:, 0]
        pending += accept_len
        if plan.flush:
            _flush(ctx, state, plan)
    state.remaining[s] -= accept_len
    state.bonus[s] = chosen
    timer.mark("commit")
    committed = torch.full((plan.bucket, max_depth + 1), -1, dtype=torch.int64, device=ids.device)
    committed[:, 0] = torch.where(active, chosen, -1)
    return _pack(accept_len, committed, touched)


def _tree_round(ctx, state, plan, max_depth, timer):
    s = slice(0, plan.bucket)
    active, bonus = state.taking_part(plan.bucket), state.bonus[s]
    cache = state.drafter_view(plan.bucket)
    if plan.flush:
        _flush(ctx, state, plan)
    draft = ctx.drafter.draft_logits(ctx.target, bonus, cache, plan.key_limit)  # [B, D, V]
    timer.mark("draft")
    lp, tok = topk_logprobs(draft, plan.k)
    if plan.k > 1:  # chain slots keep rank 0 only: the builder never pushes a -inf candidate
        ranks = torch.arange(plan.k, device=lp.device)
        lp = lp.masked_fill(state.chain[s, None, None] & (ranks > 0), float("-inf"))
    timer.mark("topk")
    trees = build_trees(lp, tok, plan.budget)
    # A request with a smaller budget keeps the first node_limit nodes: pop order does not depend
    # on the budget, so they are exactly its own best-first tree.
    trees.num_nodes = torch.minimum(trees.num_nodes, state.node_limit[s]) * active
    timer.mark("build")
    root = torch.zeros(plan.bucket, 1, dtype=torch.int64, device=bonus.device)
    ids = torch.cat([bonus[:, None], trees.tokens.clamp_min(0)], 1)  # [B, N]: root, then nodes
    positions = state.prefix_lens[s].long()[:, None] + torch.cat([root, trees.depths.clamp_min(0)], 1)
    num_rows = ((trees.num_nodes + 1) * active).int()  # rows count the root; trees' nodes do not
    logits, hidden, touched = _verify(ctx, state, plan, ids, positions, num_rows, trees.visibility)
    timer.mark("verify")
    posterior = _choose(state, plan, logits, positions)  # [B, N]
    accepted, accept_len, new_bonus = accept_paths(trees, posterior)
    accept_len = accept_len * active
    timer.mark("accept")
    commit(ctx.caches, state.block_table[s], state.prefix_lens[s], accepted, accept_len, active, ctx.page_size,
           ctx.scratch_page, ctx.target.norm.policy)  # the model's kernel policy
    rows = accepted.clamp_min(0)
    features = torch.cat(hidden, -1)
    features = features.gather(1, rows[..., None].expand(-1, -1, features.shape[-1]))
    ctx.drafter.append_context(cache, features, accept_len, check=False)
    state.prefix_lens[s] += accept_len.int()
    state.remaining[s] -= accept_len
    state.bonus[s] = new_bonus
    # The committed tokens are the target's choices along the path: node k + 1's token equals the
    # choice at node k, and the last choice is the bonus.
    steps = torch.arange(max_depth + 1, device=rows.device)
    committed = torch.where(steps < accept_len[:, None], posterior.gather(1, rows), -1)
    timer.mark("commit")
    return _pack(accept_len, committed, touched, *([accepted] if plan.paths else []))


def _flush(ctx, state, plan):
    """Append the rows plain steps set aside to the drafter's context (one pass for all of them)."""
    s = slice(0, plan.bucket)
    ctx.drafter.append_context(state.drafter_view(plan.bucket), state.pending_features[s], state.pending_rows[s],
                               check=False)
    state.pending_rows[s] = 0


def _pack(accept_len, committed, touched, *info):
    parts = [accept_len[:, None], committed] + ([touched] if touched is not None else []) + list(info)
    return torch.cat(parts, 1)
