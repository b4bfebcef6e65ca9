"""Prefill: a batch of new prompts into the paged cache, in chunks of bounded size.

Chunk c runs rows c * chunk .. (c + 1) * chunk - 1 of every prompt still that long, causally
over the part already in the cache; `chunk` bounds the rows per request per call, so a long
prompt is spread over several forwards. Only each prompt's last row goes through the lm_head. The
hidden states of the drafter's target layers are appended to its context for every prompt token,
and the target's choice after the last row is the first generated token (the first bonus).
Its host inputs reach the device through page-locked memory (paged.to_device), so the host
queues the whole prefill behind the round in flight without waiting for it.
Attention is MLA's prefill form: the cached latents expanded with kv_b_proj, causal SDPA
(models/paged.py's PrefillMeta).
"""

from __future__ import annotations

import torch

from ..models.paged import PrefillMeta, to_device
from .batch import BatchState
from .round import RoundContext
from .sampling import choose_tokens


def prefill(ctx: RoundContext, state: BatchState, slots: list[int], prompts: list[list[int]], chunk: int,
            *, any_sampled: bool, any_filtered: bool) -> torch.Tensor:
    """Fill the cache of `slots` with `prompts` (token ids, each >= 1 long) and choose each first
    token; returns int64 [len(slots)] on the device (also stored as the slots' bonus)."""
    device = state.bonus.device
    lengths = [len(p) for p in prompts]
    last_logits: list[torch.Tensor | None] = [None] * len(slots)
    for start in range(0, max(lengths), chunk):
        part = [i for i, n in enumerate(lengths) if n > start]  # prompts that reach this chunk
        rows = min(chunk, max(lengths[i] for i in part) - start)
        counts = [min(rows, lengths[i] - start) for i in part]
        ids = torch.zeros(len(part), rows, dtype=torch.int64)
        for j, i in enumerate(part):
            ids[j, : counts[j]] = torch.tensor(prompts[i][start : start + counts[j]])
        ids = to_device(ids, torch.int64, device)
        part_slots = to_device([slots[i] for i in part], torch.int64, device)
        meta = PrefillMeta.build(state.block_table[part_slots], [start] * len(counts), counts, rows,
                                 page_size=ctx.page_size, scratch_page=ctx.scratch_page)
        num_rows = meta.num_rows
        layers = ctx.feature_layers if ctx.drafter is not None else ()
        logits, hidden = ctx.target.forward_paged(ids, meta, ctx.caches, layers, logit_rows=(num_rows - 1).long())
        if ctx.drafter is not None:
            ctx.drafter.append_context(state.drafter, torch.cat(hidden, -1), num_rows.long(), check=False, rows=part_slots)
        for j, i in enumerate(part):
            if start + counts[j] == lengths[i]:
                last_logits[i] = logits[j, 0]
    logits = torch.stack(last_logits)[:, None]  # [B, 1, V]
    slot_ids = to_device(slots, torch.int64, device)
    return first_tokens(state, slot_ids, logits, to_device(lengths, torch.int64, device), any_sampled, any_filtered)


def prefill_from_start(ctx: RoundContext, state: BatchState, slot_ids: torch.Tensor, ids: torch.Tensor,
                       lengths: torch.Tensor, *, any_sampled: bool, any_filtered: bool) -> torch.Tensor:
    """Whole prompts in one chunk from position 0, from device tensors alone (static shapes, no
    host read: engine/prefill_graphs.py captures it). ids int64 [P, R] (row n >= lengths[p] is
    padding, written to the scratch page), slot_ids int64 [P], lengths int32 [P] (1 .. R).
    Returns the first tokens int64 [P] (also the slots' bonus), as prefill does."""
    meta = PrefillMeta.from_start(state.block_table[slot_ids], lengths, ids.shape[1], page_size=ctx.page_size,
                                  scratch_page=ctx.scratch_page)
    layers = ctx.feature_layers if ctx.drafter is not None else ()
    logits, hidden = ctx.target.forward_paged(ids, meta, ctx.caches, layers, logit_rows=(lengths - 1).long())
    if ctx.drafter is not None:
        ctx.drafter.append_context(state.drafter, torch.cat(hidden, -1), lengths.long(), check=False, rows=slot_ids)
    return first_tokens(state, slot_ids, logits, lengths.long(), any_sampled, any_filtered)


def first_tokens(state: BatchState, slot_ids: torch.Tensor, logits: torch.Tensor, lengths: torch.Tensor,
                 any_sampled: bool, any_filtered: bool) -> torch.Tensor:
    """The target's choice after each prompt's last row (logits float32 [P, 1, V], lengths int64
    [P]: the first new token's position), stored as the slots' bonus; int64 [P]."""
    positions = lengths[:, None]
    first = choose_tokens(logits, positions, state.temperature[slot_ids], state.top_k[slot_ids], state.top_p[slot_ids],
                          state.seed[slot_ids], any_sampled=any_sampled, any_filtered=any_filtered)[:, 0]
    state.prefix_lens[slot_ids] = lengths.int()
    state.bonus[slot_ids] = first
    return first
