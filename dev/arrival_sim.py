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
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from engine_clients import burst_decode_tokens_per_s, run_clients  # noqa: E402
from serve_bench import load_prompts  # noqa: E402

from ddtree import Engine, SamplingParams  # noqa: E402


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
    for c in args.concurrency:
        engine = Engine.from_pretrained(max_batch=c, max_budget=64)
        count = args.requests_per_client * c
        ids = [engine.tokenize(prompts[i % len(prompts)]) for i in range(count)]
        for config in args.configs:
            mode, budget = config.split(",")
            kind = {"mode": mode, "budget": budget if budget == "auto" else int(budget)}
            run_clients(engine, ids, c, params, kind)  # compile, capture, round costs
            engine_rate, burst_full = burst_decode_tokens_per_s(engine, ids, params, kind)  # all added at once
            print(f"c={c} {config}: engine formula {engine_rate:.0f} tokens/s (all added at once: "
                  f"{burst_full['steps']} steps, {burst_full['prefills']} prefills of "
                  f"{burst_full['prefill_rows_mean']:.1f} rows, batch {burst_full['batch_mean']:.1f}, "
                  f"step {burst_full['step_ms_mean']:.2f} ms)", flush=True)
            for delay in args.delays_ms:
                r = run_clients(engine, ids, c, params, kind, delay / 1e3)
                print(f"c={c} {config} delay {delay:g} ms: server formula {r['decode_tokens_per_s']:.0f} tokens/s "
                      f"({r['decode_tokens_per_s'] / engine_rate:.3f} of the engine's), {r['steps']} steps, "
                      f"{r['prefills']} prefills of {r['prefill_rows_mean']:.1f} rows, batch {r['batch_mean']:.1f}, "
                      f"step {r['step_ms_mean']:.2f} ms, TTFT p50 {r['ttft_p50_ms']:.1f} ms", flush=True)
                if budget == "auto":
                    print(f"  auto's tree sizes (size: request rounds): {dict(sorted(r['tree_sizes'].items()))}")
            if budget == "auto" and engine.sizer is not None and engine.sizer.costs is not None:
                table = engine.sizer.costs
                for bucket in sorted(b for b in table.buckets() if b >= c // 2):  # what the sizer read at this batch
                    print(f"  round costs at bucket {bucket} (ms): "
                          f"{ {size: round(s * 1e3, 3) for size, s in sorted(table.seconds[bucket].items())} }")
        engine = None
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
