"""The engine driven as `ddtree serve` drives it, in this process: c clients, each adding its next
prompt `delay` ms after its last request finished (a client's round trip), beside the engine's own
run of the same prompts (all added at once, serve_vs_engine's engine side). Per run: decode tokens/s
by serve_vs_engine's server formula (tokens after each first over the wall time less the clients'
summed times to first token, per client) and by its engine formula (the same prompts' wall time at
max_new_tokens = 1 taken off), steps, prefill passes and their mean rows, the mean running batch
and the mean step: does the arrivals' staggering cost the tree modes their rounds (issue 36)?

    python dev/arrival_sim.py --concurrency 32 64 --configs ar,1 ddtree,16 --delays-ms 0 1 3
"""

from __future__ import annotations

import argparse
import heapq
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from serve_bench import load_prompts  # noqa: E402

from ddtree import Engine, SamplingParams  # noqa: E402


def sync(engine: Engine) -> None:
    if engine.device.type == "cuda":
        torch.cuda.synchronize()


def clients_run(engine: Engine, ids: list[list[int]], c: int, delay_s: float, kind: dict, params) -> dict:
    """The prompts from c clients sharing one queue, each adding its next prompt delay_s after its
    last request's final step returned."""
    queue = list(reversed(ids))
    arrivals = [(0.0, i) for i in range(c)]  # (due, client), seconds after start
    sent, ttft, tokens = {}, [], 0
    steps = prefills = prefill_rows = batch_sum = 0
    prefill = engine.worker.prefill

    def counted(table, slots, *rest):
        nonlocal prefills, prefill_rows
        prefills += 1
        prefill_rows += len(slots)
        return prefill(table, slots, *rest)

    engine.worker.prefill = counted
    sync(engine)
    start = time.perf_counter()
    try:
        while queue or arrivals or engine.has_unfinished():
            now = time.perf_counter() - start
            while arrivals and arrivals[0][0] <= now and queue:
                _, client = heapq.heappop(arrivals)
                rid = engine.add_request(queue.pop(), params, **kind)
                sent[rid] = (now, client)
            if not queue:
                arrivals.clear()
            if not engine.has_unfinished():
                if not arrivals:
                    break
                time.sleep(max(0.0, arrivals[0][0] - now))
                continue
            outputs = engine.step()
            steps += 1
            batch_sum += engine.num_running
            now = time.perf_counter() - start
            for out in outputs:
                at, client = sent[out.request_id]
                if at is not None:
                    ttft.append(now - at)
                    sent[out.request_id] = (None, client)
                if out.finished:
                    tokens += len(engine.take_result(out.request_id).token_ids)
                    heapq.heappush(arrivals, (now + delay_s, client))
        sync(engine)
        wall = time.perf_counter() - start
    finally:
        engine.worker.prefill = prefill
    waited = sum(ttft) / c
    return {"decode_tokens_per_s": (tokens - len(ids)) / max(wall - waited, 1e-9), "wall_s": wall,
            "ttft_p50_ms": statistics.median(ttft) * 1e3, "steps": steps, "prefills": prefills,
            "prefill_rows_mean": prefill_rows / max(prefills, 1), "batch_mean": batch_sum / max(steps, 1),
            "step_ms_mean": wall / max(steps, 1) * 1e3, "tokens": tokens}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[32, 64])
    parser.add_argument("--configs", nargs="+", default=["ar,1", "ddtree,16"])
    parser.add_argument("--delays-ms", type=float, nargs="+", default=[0.0, 1.0, 3.0])
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--requests-per-client", type=int, default=16)
    args = parser.parse_args()
    prompts = load_prompts(None)
    params = SamplingParams(max_new_tokens=args.max_tokens, ignore_eos=True)
    first = SamplingParams(max_new_tokens=1, ignore_eos=True)
    for c in args.concurrency:
        engine = Engine.from_pretrained(max_batch=c, max_budget=64)
        count = args.requests_per_client * c
        ids = [engine.tokenize(prompts[i % len(prompts)]) for i in range(count)]
        for config in args.configs:
            mode, budget = config.split(",")
            kind = {"mode": mode, "budget": budget if budget == "auto" else int(budget)}
            clients_run(engine, ids, c, 0.0, kind, params)  # compile, capture, round costs
            burst = clients_run(engine, ids, count, 0.0, kind, first)  # all at once: the prefills alone
            burst_full = clients_run(engine, ids, count, 0.0, kind, params)
            engine_rate = (burst_full["tokens"] - count) / (burst_full["wall_s"] - burst["wall_s"])
            print(f"c={c} {config}: engine formula {engine_rate:.0f} tokens/s (all added at once: "
                  f"{burst_full['steps']} steps, {burst_full['prefills']} prefills of "
                  f"{burst_full['prefill_rows_mean']:.1f} rows, batch {burst_full['batch_mean']:.1f}, "
                  f"step {burst_full['step_ms_mean']:.2f} ms)", flush=True)
            for delay in args.delays_ms:
                r = clients_run(engine, ids, c, delay / 1e3, kind, params)
                print(f"c={c} {config} delay {delay:g} ms: server formula {r['decode_tokens_per_s']:.0f} tokens/s "
                      f"({r['decode_tokens_per_s'] / engine_rate:.3f} of the engine's), {r['steps']} steps, "
                      f"{r['prefills']} prefills of {r['prefill_rows_mean']:.1f} rows, batch {r['batch_mean']:.1f}, "
                      f"step {r['step_ms_mean']:.2f} ms, TTFT p50 {r['ttft_p50_ms']:.1f} ms", flush=True)
        engine = None
        torch.cuda.empty_cache() if torch.cuda.is_available() else None


if __name__ == "__main__":
    main()
