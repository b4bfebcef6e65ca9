"""The device side of an engine: the models' caches, the batch state and the captured rounds.

Every change the engine makes on the device goes through a Worker's four methods, called with
plain values (slots, settings, a block table, a plan). In one process that is all they are. With
tensor parallelism (parallel/relay.py) rank 0's Worker first sends each call to the other ranks,
whose Workers run the same call on their shards: one round is one SPMD step, and the only host
traffic is what rank 0 sends.
"""

from __future__ import annotations

import contextlib

import torch

from .batch import BatchState, SlotSettings
from .graphs import RoundGraphs
from .prefill import prefill
from .prefill_graphs import PrefillGraphs
from .round import RoundContext, RoundPlan, run_round
from .timing import StageTimer


class Worker:
    def __init__(self, ctx: RoundContext, state: BatchState, graphs: RoundGraphs | None, max_depth: int,
                 prefill_chunk: int, relay=None):
        """relay: rank 0's parallel.relay.Relay (None: one process, or a follower rank)."""
        self.ctx, self.state, self.graphs = ctx, state, graphs
        self.max_depth, self.prefill_chunk, self.relay = max_depth, prefill_chunk, relay
        self.device = state.device
        # On CUDA an admission's prompts are prefilled in groups padded to a row bucket, replayed from
        # graphs where the rounds have graphs (engine/prefill_graphs.py). INT4 experts' many-row path
        # reads the chosen experts back to the host, which no graph holds.
        capturable = graphs is not None and ctx.target.cfg.int4_experts is None
        self.prefill_graphs = (PrefillGraphs(ctx, state, graphs.pool if capturable else None, prefill_chunk)
                               if self.device.type == "cuda" else None)

    def _call(self, op: str, *args):
        """Around rank 0's part of a call: the call sent to the other ranks first (parallel.relay)."""
        return self.relay.call(op, *args) if self.relay is not None else contextlib.nullcontext()

    def occupy(self, slot: int, settings: SlotSettings) -> None:
        """A request takes `slot` (BatchState.occupy)."""
        with self._call("occupy", slot, settings):
            self.state.occupy(slot, settings)

    def vacate(self, slot: int) -> None:
        with self._call("vacate", slot):
            self.state.vacate(slot)

    def prefill(self, table: torch.Tensor, slots: list[int], prompts: list[list[int]], sampled: bool,
                filtered: bool) -> torch.Tensor:
        """The block table (host int32 [max_batch, pages]) in place, then the prompts prefilled into
        `slots` (engine/prefill.py); returns the first tokens int64 [len(slots)] on the device."""
        with self._call("prefill", table, slots, prompts, sampled, filtered):
            self.state.block_table.copy_(self._pinned(table), non_blocking=True)
            if self.prefill_graphs is not None and self.prefill_graphs.covers(prompts):
                return self.prefill_graphs.prefill(slots, prompts, sampled, filtered)
            return prefill(self.ctx, self.state, slots, prompts, self.prefill_chunk, any_sampled=sampled,
                           any_filtered=filtered)

    def round(self, table: torch.Tensor, plan: RoundPlan, timer: StageTimer | None = None) -> torch.Tensor:
        """The first plan.bucket rows of the block table (host int32) in place, then one round
        (replayed from its CUDA graph where there is one); returns its int64 result on the device."""
        with self._call("round", table, plan):
            timer = timer or StageTimer(self.device, enabled=False)
            self.state.block_table[: plan.bucket].copy_(self._pinned(table), non_blocking=True)
            if self.graphs is not None:
                return self.graphs.run(plan, timer)
            return run_round(self.ctx, self.state, plan, self.max_depth, timer)

    def _pinned(self, table: torch.Tensor) -> torch.Tensor:
        """On CUDA a page-locked snapshot of a host table (the host may change it afterwards; a
        copy from pageable memory would wait for the stream)."""
        return table.pin_memory() if self.device.type == "cuda" else table
