"""Timing one round repeatedly: eager with the engine's StageTimer, and replayed from a CUDA graph.

Eager: each repeat restores the batch (PrefixBatch.restore), runs run_round with a StageTimer
(CUDA events at every stage boundary, wall clock on the CPU), synchronizes and reads the stage
times. On the GPU these include the gaps where the device waits for the host's launches: what
the engine pays today, which runs rounds eagerly.

Graph: after the eager repeats (kernels compiled, allocator warm), one more round runs on a side
stream, then restore + run_round are captured together (so every replay starts from the same
prefix) with a stage timer whose events are `external`: inside a capture they become event-record
nodes, so each replay re-records them and the stage times of that replay can be read after it.
The replay's total comes from ordinary events around graph.replay() and includes the restore's
three small copies.
"""

from __future__ import annotations

import statistics
import time

import torch

from ddtree.engine.timing import StageTimer
from ddtree.models.layers import MoE


def spread(samples: list[float]) -> dict:
    """Median, p10 and p90 (nearest rank) of samples, and their count."""
    ordered = sorted(samples)
    rank = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))]  # noqa: E731
    return {"median": statistics.median(ordered), "p10": rank(0.1), "p90": rank(0.9), "n": len(ordered)}


def summarize(per_repeat: list[dict[str, float]], totals: list[float] | None = None) -> dict:
    """{stage: spread of microseconds} from per-repeat {stage: seconds}; "round" from totals
    (microseconds) when given, else from each repeat's sum of stages."""
    stages = list(per_repeat[0]) if per_repeat else []
    out = {s: spread([r[s] * 1e6 for r in per_repeat]) for s in stages}
    out["round"] = spread(totals if totals is not None else [sum(r.values()) * 1e6 for r in per_repeat])
    return out


class GraphStageTimer:
    """StageTimer's interface on events made once with external=True (see the module docstring)."""

    def __init__(self, marks: int = 7):
        self.events = [torch.cuda.Event(enable_timing=True, external=True) for _ in range(marks)]
        for event in self.events:  # created outside the capture
            event.record()
        self.stages: list[str] = []

    def start(self) -> None:
        self.stages = []
        self.events[0].record()

    def mark(self, stage: str) -> None:
        self.stages.append(stage)
        self.events[len(self.stages)].record()

    def seconds(self) -> dict[str, float]:
        pairs = zip(self.stages, self.events, self.events[1:])
        return {stage: before.elapsed_time(after) / 1e3 for stage, before, after in pairs}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_eager(run, restore, device: torch.device, repeats: int, warmup: int) -> list[dict[str, float]]:
    """run(timer) runs one round; returns each timed repeat's {stage: seconds}."""
    timer = StageTimer(device)
    samples = []
    for i in range(warmup + repeats):
        restore()
        timer.start()
        run(timer)
        sync(device)
        if i >= warmup:
            samples.append(timer.seconds())
    return samples


def _capture(run, restore, stream, timer) -> torch.cuda.CUDAGraph:
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        restore()
        timer.start()
        run(timer)
    torch.cuda.synchronize()
    return graph


def time_graph(run, restore, repeats: int) -> tuple[list[dict[str, float]] | None, list[float]]:
    """(per-replay {stage: seconds}, or None where in-graph events are unavailable, and the replay
    totals in microseconds). Raises what a capture without stage events raises."""
    device = torch.device("cuda", torch.cuda.current_device())
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # one round on the capture stream before capturing
        restore()
        run(StageTimer(device, enabled=False))
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    try:
        timer = GraphStageTimer()
        graph = _capture(run, restore, stream, timer)
    except Exception as err:  # no external events here: time the round as a whole
        print(f"  capture with in-graph stage events failed ({err!r}); capturing the round alone", flush=True)
        torch.cuda.synchronize()
        timer = None
        graph = _capture(run, restore, stream, StageTimer(device, enabled=False))
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    stages, totals = ([] if timer else None), []
    for i in range(repeats + 1):  # the first replay is a warm-up
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        if i == 0:
            continue
        totals.append(start.elapsed_time(end) * 1e3)
        if stages is not None:
            try:
                stages.append(timer.seconds())
            except RuntimeError as err:  # the events exist but cannot be read: totals only
                print(f"  graph stage events unreadable ({err!r}); round totals only", flush=True)
                stages = None
    del graph
    torch.cuda.synchronize()
    return stages, totals


def routed_experts_union(target, run) -> list[int]:
    """Distinct routed experts per MoE layer over all rows of the target forwards in run() (one
    round: its verify), read through forward hooks on the routers."""
    seen: list[torch.Tensor] = []
    hooks = [layer.mlp.gate.register_forward_hook(lambda _m, _i, out: seen.append(out[1]))
             for layer in target.layers if isinstance(layer.mlp, MoE)]
    try:
        run()
    finally:
        for hook in hooks:
            hook.remove()
    return [int(ids.unique().numel()) for ids in seen]


def cpu_ceilings() -> dict:
    """The CPU's copy rate and float32 matmul rate, for smoke runs only (floors on a CPU mean little)."""
    def best(fn, trials=5):
        times = []
        for _ in range(trials):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return min(times)

    src = torch.empty(64 << 20, dtype=torch.uint8).random_()
    dst = torch.empty_like(src)
    a, b = torch.randn(512, 512), torch.randn(512, 512)
    return {"copy_bandwidth_GBps": 2 * src.numel() / best(lambda: dst.copy_(src)) / 1e9,
            "bf16_matmul_TFLOPs": 2 * 512**3 / best(lambda: a @ b) / 1e12, "note": "CPU smoke run: float32 matmul"}
