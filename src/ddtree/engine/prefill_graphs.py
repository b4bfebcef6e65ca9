"""CUDA graphs of prefills: an eager prefill launches every layer's kernels from Python (hundreds of
launches: about 12 ms of host time for 0.8 ms of device time on the demo pair,
benchmarks/results/admission_profile-torch-nvidia-h100-2f6753c.log), and under continuous batching
a tree's request ends on a round of its own, so its successor is admitted alone, one such prefill
each. A replay costs one launch.

An admission's prompts, sorted by length, go in groups of 4, then 2, then 1 (GROUPS); a group is
padded to the row bucket of its longest prompt (16, 32, 64, ...: at most twice its rows) and run
by prefill.prefill_from_start, whose shapes depend on (group, bucket) alone. As with RoundGraphs, a
shape's first prefill (per sampling flags) runs eagerly, compiling its kernels; its second captures
the graph, which executes nothing, and replays it; later ones replay. `ddtree serve` captures them
all at start-up (capture_prefill_graphs). The graphs share the rounds' memory pool: each replay's
first tokens are copied out before the next replay. A prompt longer than the largest bucket sends
its admission to prefill.prefill (chunks, eager). A CUDA engine without graphs runs the same padded
groups eagerly, so that it computes what an engine with them does (a GEMM of other rows may round
differently).
"""

from __future__ import annotations

import logging

import torch

from ..models.paged import to_device
from .batch import BatchState
from .prefill import prefill_from_start
from .round import RoundContext

log = logging.getLogger("ddtree.engine")

GROUPS = (4, 2, 1)  # prompts per prefill graph: larger admissions replay several
SMALLEST_BUCKET = 16


def groups_of(count: int) -> list[int]:
    """The group sizes an admission of `count` prompts is prefilled in: 4s, then a 2, then a 1."""
    sizes = []
    for size in GROUPS:
        sizes += [size] * ((count - sum(sizes)) // size)
    return sizes


def row_buckets(largest: int) -> list[int]:
    """Powers of two from SMALLEST_BUCKET up to the first that holds `largest` rows."""
    buckets = [SMALLEST_BUCKET]
    while buckets[-1] < largest:
        buckets.append(2 * buckets[-1])
    return buckets


class PrefillGraphs:
    """Per (group, row bucket, sampling flags) CUDA graphs of prefill_from_start."""

    def __init__(self, ctx: RoundContext, state: BatchState, pool, largest: int):
        """pool: the round graphs' memory pool (None: never capture, every prefill eager at its
        padded shape); largest: the longest prompt taken (the engine's prefill chunk: a longer
        prompt is prefilled in chunks)."""
        self.ctx, self.state, self.pool, self.largest = ctx, state, pool, largest
        self.buckets = row_buckets(largest)
        self._graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]] = {}
        self._seen: set[tuple] = set()
        self.replays = self.eager_prefills = 0

    @property
    def captures(self) -> int:
        return len(self._graphs)

    def covers(self, prompts: list[list[int]]) -> bool:
        """Whether prefill() takes these prompts (else prefill.prefill runs them in chunks)."""
        return max(map(len, prompts)) <= self.largest

    def prefill(self, slots: list[int], prompts: list[list[int]], any_sampled: bool, any_filtered: bool) -> torch.Tensor:
        """The prompts into their slots (the block table already on the device), in groups of
        similar length; returns the first tokens int64 [len(slots)] on the device, in the order
        given, as prefill.prefill does."""
        order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
        firsts, start = [], 0
        for size in groups_of(len(prompts)):
            group = order[start : start + size]
            firsts.append(self._group([slots[i] for i in group], [prompts[i] for i in group], any_sampled, any_filtered))
            start += size
        first = firsts[0] if len(firsts) == 1 else torch.cat(firsts)
        if order == sorted(order):
            return first
        back = to_device(sorted(range(len(order)), key=order.__getitem__), torch.int64, first.device)
        return first[back]

    def _group(self, slots: list[int], prompts: list[list[int]], any_sampled: bool, any_filtered: bool) -> torch.Tensor:
        size, rows = len(prompts), next(b for b in self.buckets if b >= max(map(len, prompts)))
        key = (size, rows, any_sampled, any_filtered)
        host = torch.zeros(size * (rows + 2), dtype=torch.int64)  # prompts padded to the bucket, slots, lengths
        for i, prompt in enumerate(prompts):
            host[i * rows : i * rows + len(prompt)] = torch.tensor(prompt, dtype=torch.int64)
        host[size * rows :] = torch.tensor(slots + [len(p) for p in prompts], dtype=torch.int64)
        entry = self._graphs.get(key)
        if entry is None and (key not in self._seen or self.pool is None):
            self._seen.add(key)
            self.eager_prefills += 1
            return self._run(to_device(host, torch.int64, self.state.device), *key)
        graph, inputs, first = entry if entry is not None else self._capture(key)
        inputs.copy_(host.pin_memory(), non_blocking=True)
        graph.replay()
        self.replays += 1
        return first.clone()  # the next replay of any graph may reuse this output's memory

    def _run(self, inputs: torch.Tensor, size: int, rows: int, any_sampled: bool, any_filtered: bool) -> torch.Tensor:
        slots, lengths = inputs[size * rows :].view(2, size)
        return prefill_from_start(self.ctx, self.state, slots, inputs[: size * rows].view(size, rows), lengths.int(),
                                  any_sampled=any_sampled, any_filtered=any_filtered)

    def _capture(self, key: tuple):
        size, rows = key[:2]
        inputs = torch.zeros(size * (rows + 2), dtype=torch.int64, device=self.state.device)
        graph = torch.cuda.CUDAGraph()
        torch.cuda.synchronize()  # what ran before must be done: capture uses a side stream
        with torch.cuda.graph(graph, pool=self.pool):
            first = self._run(inputs, *key)
        self._graphs[key] = (graph, inputs, first)
        log.info("captured the prefill graph of %d prompts of %d rows (sampled %s, top-k/top-p %s)", *key)
        return self._graphs[key]


# (temperature, top_k): greedy, sampled, sampled with a cut; the flags generation_params can give
FLAG_SETTINGS = ((0.0, 0), (1.0, 0), (1.0, 20))


def capture_prefill_graphs(engine) -> list[int]:
    """Capture every (group, row bucket) prefill graph for each sampling flag set on an idle
    engine, with stand-in prompts of max_new_tokens 1 (no round runs), so that no admission
    captures on the request path; returns the buckets captured ([] without prefill graphs, as on
    the CPU). Groups larger than the engine's batch cannot come and are left out."""
    graphs = engine.worker.prefill_graphs
    if graphs is None or graphs.pool is None:
        return []
    if engine.has_unfinished():
        raise RuntimeError("prefill graphs are captured on an idle engine: finish or abort its requests first")
    engine.drain()
    vocab, done = engine.target.cfg.vocab_size, []
    for bucket in graphs.buckets:
        rows = min(bucket, graphs.largest, engine.max_model_len - 1)
        if rows <= bucket // 2:
            break  # longer prompts than this bucket's smaller neighbour cannot come
        prompt = [(7 * i + 3) % vocab for i in range(rows)]
        for size in (s for s in GROUPS if s <= engine.max_batch):
            for temperature, top_k in FLAG_SETTINGS:
                for _ in range(2):  # eager (compiling its kernels), then captured
                    engine.generate([prompt] * size, 1, mode="ar", budget=1, temperature=temperature, top_k=top_k,
                                    seed=0)
        done.append(bucket)
    return done
