"""The engine driven in this process as `ddtree serve` drives it: c clients sharing one queue of
prompts, each adding its next request when its last one finished (after `delay_s`, a client's round
trip), through add_request / step.

Its decode tokens/s is the one serve_vs_engine computes for a server's clients: the tokens after each
request's first over the wall time less the clients' summed times to first token (per client), so an
engine and a server measured this way differ only by what serving adds. The figure it replaced there
(all prompts added at once, their wall time at max_new_tokens = 1 taken off) subtracted prefills
batched c at a time while the timed run prefilled arrivals one or two at a time: on identical steps
it read the engine up to 1.5x faster than this one (benchmarks/results/arrival_sim-*.log).
"""

from __future__ import annotations

import dataclasses
import heapq
import statistics
import time
from collections import Counter

import torch


def _sync(engine) -> None:
    if engine.device.type == "cuda":
        torch.cuda.synchronize()


def run_clients(engine, prompts: list, clients: int, params, kind: dict, delay_s: float = 0.0) -> dict:
    """The prompts (texts or token ids) from `clients` clients. Returns decode_tokens_per_s, wall_s,
    tokens (every request's), ttft_s (per request: from its add_request to the step that returned its
    first token), steps, prefills (passes) and prefill_rows_mean, batch_mean (running requests after
    each step), step_ms_mean and tree_sizes (Counter: rounds per tree size over the requests, 0 a
    plain step)."""
    if clients < 1:
        raise ValueError(f"clients must be >= 1, got {clients}")
    queue = list(reversed(prompts))
    arrivals = [0.0] * clients  # when each client sends its next request: seconds after the start (a heap)
    sent, ttft, tokens, sizes = {}, [], 0, Counter()
    steps = prefills = prefill_rows = batch_sum = 0
    prefill = engine.worker.prefill

    def counted(table, slots, *rest):
        nonlocal prefills, prefill_rows
        prefills += 1
        prefill_rows += len(slots)
        return prefill(table, slots, *rest)

    engine.worker.prefill = counted
    _sync(engine)
    start = time.perf_counter()
    try:
        while True:
            now = time.perf_counter() - start
            while arrivals and arrivals[0] <= now and queue:
                heapq.heappop(arrivals)
                sent[engine.add_request(queue.pop(), params, **kind)] = now
            if not queue:
                arrivals.clear()
            if not engine.has_unfinished():
                if not arrivals:
                    break
                time.sleep(max(0.0, arrivals[0] - now))
                continue
            outputs = engine.step()
            steps += 1
            batch_sum += engine.num_running
            now = time.perf_counter() - start
            for out in outputs:
                at = sent.pop(out.request_id, None)
                if at is not None:
                    ttft.append(now - at)
                if out.finished:
                    result = engine.take_result(out.request_id)
                    tokens += len(result.token_ids)
                    sizes.update(result.stats.tree_sizes)
                    heapq.heappush(arrivals, now + delay_s)
        _sync(engine)
        wall = time.perf_counter() - start
    finally:
        engine.worker.prefill = prefill
    waited = sum(ttft) / clients
    return {"decode_tokens_per_s": (tokens - len(prompts)) / max(wall - waited, 1e-9), "wall_s": wall,
            "tokens": tokens, "ttft_s": ttft, "ttft_p50_ms": statistics.median(ttft) * 1e3 if ttft else None,
            "steps": steps, "prefills": prefills, "prefill_rows_mean": prefill_rows / max(prefills, 1),
            "batch_mean": batch_sum / max(steps, 1), "step_ms_mean": wall / max(steps, 1) * 1e3,
            "tree_sizes": sizes}


def burst_decode_tokens_per_s(engine, prompts: list, params, kind: dict) -> tuple[float, dict]:
    """serve_vs_engine's engine figure before 2026-12-07: every prompt added at once, the wall time
    of the same prompts at max_new_tokens = 1 taken off; (that figure, the full run's run_clients
    dict)."""
    first = dataclasses.replace(params, max_new_tokens=1)
    prefills = run_clients(engine, prompts, len(prompts), first, kind)["wall_s"]
    full = run_clients(engine, prompts, len(prompts), params, kind)
    return (full["tokens"] - len(prompts)) / max(full["wall_s"] - prefills, 1e-9), full
