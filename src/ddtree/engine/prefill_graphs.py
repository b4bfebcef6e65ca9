"""CUDA graphs of prefills of one prompt: under continuous batching a tree's request ends on a round
of its own, so its successor is admitted alone, and an eager prefill launches every layer's kernels
from Python (hundreds of launches: about 12 ms of host time for 0.8 ms of device time on the demo
pair, benchmarks/results/admission_profile-torch-nvidia-h100-2f6753c.log). A replay costs one
launch.

A prompt of at most the largest row bucket's tokens is padded to its bucket (16, 32, 64, ...: at
most twice its rows) and run by prefill.prefill_from_start, whose shapes depend on the bucket
alone. As with RoundGraphs, a bucket's first prefill (per sampling flags) runs eagerly at the padded
shape, compiling its kernels; its second captures the graph, which executes nothing, and replays it;
later ones replay. The graphs share the rounds' memory pool: each replay's first token is copied
out before the next replay.

An admission of more than MAX_PROMPTS prompts, or of a longer prompt, runs prefill.prefill (one
batched eager pass): replays run one prompt each, and on a large model each reads every weight.
A CUDA engine without graphs runs the same padded prefills eagerly, so that it computes what an
engine with them does (a GEMM of other rows may round differently).
"""

from __future__ import annotations

import logging

import torch

from ..models.paged import to_device
from .batch import BatchState
from .prefill import prefill_from_start
from .round import RoundContext

log = logging.getLogger("ddtree.engine")

MAX_PROMPTS = 4
SMALLEST_BUCKET = 16


def row_buckets(largest: int) -> list[int]:
    """Powers of two from SMALLEST_BUCKET up to the first that holds `largest` rows."""
    buckets = [SMALLEST_BUCKET]
    while buckets[-1] < largest:
        buckets.append(2 * buckets[-1])
    return buckets


class PrefillGraphs:
    """Per (row bucket, sampling flags) CUDA graphs of prefill_from_start over one prompt."""

    def __init__(self, ctx: RoundContext, state: BatchState, pool, largest: int):
        """pool: the round graphs' memory pool (None: never capture, every prefill eager at its
        padded shape); largest: the longest prompt taken (the engine's prefill chunk: a longer
        prompt is prefilled in chunks)."""
        self.ctx, self.state, self.pool, self.largest = ctx, state, pool, largest
        self.buckets = row_buckets(largest)
        self._graphs: dict[tuple[int, bool, bool], tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]] = {}
        self._seen: set[tuple[int, bool, bool]] = set()
        self.replays = self.eager_prefills = 0

    @property
    def captures(self) -> int:
        return len(self._graphs)

    def covers(self, prompts: list[list[int]]) -> bool:
        """Whether prefill() takes these prompts (else prefill.prefill runs them together)."""
        return len(prompts) <= MAX_PROMPTS and max(map(len, prompts)) <= self.largest

    def prefill(self, slots: list[int], prompts: list[list[int]], any_sampled: bool, any_filtered: bool) -> torch.Tensor:
        """Each prompt into its slot (the block table already on the device); returns the first
        tokens int64 [len(slots)] on the device, as prefill.prefill does."""
        firsts = [self._one(slot, prompt, any_sampled, any_filtered) for slot, prompt in zip(slots, prompts)]
        return firsts[0] if len(firsts) == 1 else torch.cat(firsts)

    def _one(self, slot: int, prompt: list[int], any_sampled: bool, any_filtered: bool) -> torch.Tensor:
        rows = next(b for b in self.buckets if b >= len(prompt))
        key = (rows, any_sampled, any_filtered)
        host = torch.zeros(rows + 2, dtype=torch.int64)  # the prompt padded to its bucket, then slot and length
        host[: len(prompt)] = torch.tensor(prompt, dtype=torch.int64)
        host[rows], host[rows + 1] = slot, len(prompt)
        entry = self._graphs.get(key)
        if entry is None and (key not in self._seen or self.pool is None):
            self._seen.add(key)
            self.eager_prefills += 1
            return self._run(to_device(host, torch.int64, self.state.device), rows, any_sampled, any_filtered)
        graph, inputs, first = entry if entry is not None else self._capture(key)
        inputs.copy_(host.pin_memory(), non_blocking=True)
        graph.replay()
        self.replays += 1
        return first.clone()  # the next replay of any graph may reuse this output's memory

    def _run(self, inputs: torch.Tensor, rows: int, any_sampled: bool, any_filtered: bool) -> torch.Tensor:
        return prefill_from_start(self.ctx, self.state, inputs[rows : rows + 1], inputs[:rows].view(1, rows),
                                  inputs[rows + 1 :].int(), any_sampled=any_sampled, any_filtered=any_filtered)

    def _capture(self, key: tuple[int, bool, bool]):
        rows = key[0]
        inputs = torch.zeros(rows + 2, dtype=torch.int64, device=self.state.device)
        graph = torch.cuda.CUDAGraph()
        torch.cuda.synchronize()  # what ran before must be done: capture uses a side stream
        with torch.cuda.graph(graph, pool=self.pool):
            first = self._run(inputs, rows, *key[1:])
        self._graphs[key] = (graph, inputs, first)
        log.info("captured the prefill graph of %d rows (sampled %s, top-k/top-p %s)", *key)
        return self._graphs[key]


# (temperature, top_k): greedy, sampled, sampled with a cut; the flags generation_params can give
FLAG_SETTINGS = ((0.0, 0), (1.0, 0), (1.0, 20))


def capture_prefill_graphs(engine) -> list[int]:
    """Capture every row bucket's prefill graphs (each sampling flag set) on an idle engine, with
    stand-in prompts of max_new_tokens 1 (no round runs), so that no admission captures on the
    request path; returns the buckets captured ([] without prefill graphs, as on the CPU)."""
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
        for temperature, top_k in FLAG_SETTINGS:
            for _ in range(2):  # eager (compiling its kernels), then captured
                engine.generate([prompt], 1, mode="ar", budget=1, temperature=temperature, top_k=top_k, seed=0)
        done.append(bucket)
    return done
