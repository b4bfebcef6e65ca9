"""CUDA graphs of whole rounds: one per RoundPlan, captured lazily, replayed with the batch padded
to its bucket.

run_round is written for capture (static shapes for a plan, no host reads), so the graph of a plan
is simply run_round recorded once. The first round of a plan runs eagerly: it compiles the Triton
kernels and initializes cuBLAS before anything is recorded, and it does real work, so no state has
to be saved and restored around a warm-up. The second round of that plan captures the graph (which
executes nothing) and replays it; every later one only replays.

A replay reads the batch state where the capture found it (the same tensors, updated in place
between rounds) and writes its result into the graph's own output tensor: read that before the
next replay of any graph, since all graphs share one memory pool.
"""

from __future__ import annotations

import logging
import time
from collections import Counter

import torch

from .batch import BatchState
from .round import RoundContext, RoundPlan, run_round
from .timing import StageTimer

log = logging.getLogger("ddtree.engine")


def graphs_wanted(cuda_graphs: bool | None, device: torch.device, dtype: torch.dtype) -> bool:
    """Engine's cuda_graphs switch resolved for a model of `dtype` on `device`: None turns graphs on
    for bf16 on sm90 / sm100, where bf16 torch._grouped_mm runs on the device; True demands them.
    Its float32 / fp16 fallback copies to the host, which a graph cannot hold (found on the H200)."""
    capturable = device.type == "cuda" and dtype == torch.bfloat16
    if cuda_graphs is None:
        return capturable and torch.cuda.get_device_capability(device)[0] in (9, 10)
    if cuda_graphs and not capturable:
        raise ValueError(f"cuda_graphs needs a bf16 model on a CUDA device, got {dtype} on {device}")
    return bool(cuda_graphs)


class RoundGraphs:
    """Per-plan CUDA graphs of run_round over one engine's context and batch state."""

    def __init__(self, ctx: RoundContext, state: BatchState, max_depth: int, max_graphs: int = 1024):
        """max_graphs: plans to keep graphs for; a new plan past it runs eagerly (logged once)."""
        if state.device.type != "cuda":
            raise ValueError(f"CUDA graphs need the engine on a CUDA device, got {state.device}")
        self.ctx, self.state, self.max_depth, self.max_graphs = ctx, state, max_depth, max_graphs
        self.pool = torch.cuda.graph_pool_handle()
        self._graphs: dict[RoundPlan, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._seen: set[RoundPlan] = set()
        self._idle_timer = StageTimer(state.device, enabled=False)
        self.replays = 0
        self.eager_rounds = 0  # a plan's first round, and every round of a plan past max_graphs
        self.eager_plans: Counter[str] = Counter()  # describe(plan) -> its eager rounds
        self.warm_buckets: set[int] = set()  # budget auto's shapes captured at start-up (engine/profiling.py)

    def __len__(self) -> int:
        return len(self._graphs)

    @property
    def captures(self) -> int:
        """Graphs captured so far (each plan once; none is dropped)."""
        return len(self._graphs)

    def run(self, plan: RoundPlan, timer: StageTimer) -> torch.Tensor:
        """One round for `plan`; returns int64 [bucket, result_width] (run_round's result). Eager
        rounds mark every stage on `timer`; replays mark one stage, "round"."""
        entry = self._graphs.get(plan)
        if entry is None:
            if plan not in self._seen or len(self._graphs) >= self.max_graphs:
                if plan in self._seen:
                    log.warning("%d CUDA graphs held (max_graphs): %s runs eagerly", self.max_graphs, describe(plan))
                self._seen.add(plan)
                self.eager_rounds += 1
                self.eager_plans[describe(plan)] += 1
                return run_round(self.ctx, self.state, plan, self.max_depth, timer)
            entry = self._capture(plan)
        graph, result = entry
        graph.replay()
        self.replays += 1
        timer.mark("round")
        return result

    def _capture(self, plan: RoundPlan) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        start = time.perf_counter()
        graph = torch.cuda.CUDAGraph()
        torch.cuda.synchronize()  # the eager rounds before must be done: capture uses a side stream
        with torch.cuda.graph(graph, pool=self.pool):
            result = run_round(self.ctx, self.state, plan, self.max_depth, self._idle_timer)
        self._graphs[plan] = (graph, result)
        log.info("captured CUDA graph %d of at most %d in %.0f ms: %s", self.captures, self.max_graphs,
                 (time.perf_counter() - start) * 1e3, describe(plan))
        return graph, result


def describe(plan: RoundPlan) -> str:
    """One line naming a plan's shape, for the capture log."""
    mode = "ar" if plan.budget == 0 else f"tree budget {plan.budget}"
    extras = [s for s, on in (("sampled", plan.any_sampled), ("top-k/top-p", plan.any_filtered),
                              ("accepted paths reported", plan.paths),
                              ("drafter context appended", plan.flush)) if on]
    keys = "" if plan.key_limit is None else f", drafter keys <= {plan.key_limit}"
    return f"batch {plan.bucket}, {mode}{keys}" + "".join(f", {e}" for e in extras)
