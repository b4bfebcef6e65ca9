"""Device state of the running batch, one row per request slot.

Every tensor has max_batch rows and stays where it is for the engine's life; a round reads and
advances the first `bucket` rows in place (views, no gathers), so a round's shapes depend only on
(bucket, budget) and it can be captured once per pair. Inactive slots inside a bucket are padding:
they verify no rows, write only the scratch page and commit nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..models.drafter import DrafterCache

PENDING_ROWS = 16  # rows a slot's plain steps set aside before they are appended to the drafter's context


@dataclass
class SlotSettings:
    """What a request puts in its slot at admission (host values)."""

    node_limit: int  # tree nodes it may verify: 0 for ar, D for chain, budget for ddtree
    chain: bool
    temperature: float
    top_k: int
    top_p: float
    seed: int
    max_new_tokens: int = 1 << 62  # tokens the request may still take, its first (the prefill's) included


class BatchState:
    """Per-slot device tensors ([max_batch] unless noted):

    block_table   int32 [max_batch, pages_per_request], copied from the host's BlockManager
    prefix_lens   int32   cache entries committed (the bonus token is not among them yet)
    bonus         int64   the target's last choice: next round's root
    active        bool    slot holds a running request
    remaining     int64   tokens the request may still commit: a round skips a slot at 0, so a round
                          launched before the host has read the last one cannot outgrow the request
    node_limit    int64   tree nodes the slot may verify (0 ar, D chain, budget ddtree)
    chain         bool    keep only rank 0 at every depth (DFlash's argmax chain)
    temperature   float32, top_k int64, top_p float32, seed int64: SamplingParams
    drafter       DrafterCache [max_batch, capacity, kv_heads, head_dim] per layer, or None
    pending_features [max_batch, PENDING_ROWS, feature width]: committed rows' target features that
                  plain steps set aside for the drafter's context, appended PENDING_ROWS at a time
                  or before the next draft (one weight read for many rows); pending_rows int64
                  how many each slot holds. A plain step may also leave its row out (budget
                  "auto" far from its next tree): then prefix_lens exceeds the context entries
                  plus the set-aside rows, and the context keeps true positions (drafter_view)
    """

    def __init__(self, max_batch: int, pages_per_request: int, device: torch.device, drafter=None,
                 drafter_capacity: int = 0):
        def zeros(dtype, *shape):
            return torch.zeros(shape or (max_batch,), dtype=dtype, device=device)

        self.max_batch = max_batch
        self.device = device
        self.block_table = torch.full((max_batch, pages_per_request), -1, dtype=torch.int32, device=device)
        self.prefix_lens = zeros(torch.int32)
        self.bonus = zeros(torch.int64)
        self.active = zeros(torch.bool)
        self.remaining = zeros(torch.int64)
        self.node_limit = zeros(torch.int64)
        self.chain = zeros(torch.bool)
        self.temperature = zeros(torch.float32)
        self.top_k = zeros(torch.int64)
        self.top_p = torch.ones(max_batch, dtype=torch.float32, device=device)
        self.seed = zeros(torch.int64)
        self.drafter = drafter.new_cache(max_batch, drafter_capacity) if drafter is not None else None
        if drafter is not None:
            fc = drafter.fc.weight
            self.pending_features = torch.zeros(max_batch, PENDING_ROWS, fc.shape[1], dtype=fc.dtype, device=device)
        self.pending_rows = zeros(torch.int64)

    def occupy(self, slot: int, settings: SlotSettings) -> None:
        """A request takes `slot`: its settings go in, its drafter context starts empty."""
        self._write(slot, node_limit=settings.node_limit, chain=settings.chain, temperature=settings.temperature,
                    top_k=settings.top_k, top_p=settings.top_p, seed=settings.seed,
                    remaining=settings.max_new_tokens - 1,  # the prefill commits the first
                    prefix_lens=0, pending_rows=0, active=True)

    def vacate(self, slot: int) -> None:
        self._write(slot, active=False, prefix_lens=0, pending_rows=0)

    def _write(self, slot: int, **values) -> None:
        """Set each named per-slot tensor's row `slot` (the drafter context's length to 0 too),
        queued behind the rounds already launched. On CUDA the values come from page-locked
        memory: assigning a Python number to a CUDA tensor copies from pageable memory, which waits
        for the stream, and a request finishing while a round is in flight then stalled the host
        until that round was done."""
        fields = [getattr(self, name) for name in values]
        if self.drafter is not None:
            fields.append(self.drafter.lengths)
            values["lengths"] = 0
        if self.device.type != "cuda":
            for field, value in zip(fields, values.values()):
                field[slot] = value
            return
        for field, value in zip(fields, values.values()):
            source = torch.tensor([value], dtype=field.dtype).pin_memory()
            field[slot : slot + 1].copy_(source, non_blocking=True)

    def taking_part(self, bucket: int) -> torch.Tensor:
        """bool [bucket]: slots a round advances, active with tokens remaining."""
        return self.active[:bucket] & (self.remaining[:bucket] > 0)

    def drafter_view(self, bucket: int) -> DrafterCache:
        """The first `bucket` slots of the drafter context (views: appends write through), with
        the committed rows it left out: a slot's committed tokens are its context entries, its
        set-aside rows and the rows plain steps left out (skipped), which neither appends nor
        commits change until the round's end."""
        d = self.drafter
        lengths = d.lengths[:bucket]
        skipped = self.prefix_lens[:bucket].long() - lengths - self.pending_rows[:bucket]
        return DrafterCache([k[:bucket] for k in d.keys], [v[:bucket] for v in d.values], lengths, skipped)
