"""Where a step's wall time goes for the demo pair on a GPU: per configuration, after a warm-up
pass, the timed pass's wall time split by Engine.step's parts (admit + prefill, launch, collect),
the GPU time of its rounds (CUDA events), eager rounds, and cProfile's top host functions.

    python dev/demo_step_profile.py --batch 8 --configs ar,1 ddtree,32 ddtree,auto ddtree,auto@0
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from ddtree import Engine  # noqa: E402


def demo_prompts(count: int | None = None) -> list[str]:
    """The demo pair's held-out prompts (benchmarks/data/demo_prompts.jsonl), the first `count`."""
    lines = (ROOT / "benchmarks/data/demo_prompts.jsonl").read_text().splitlines()
    return [json.loads(line)["prompt"] for line in lines][:count]


def timed_parts(engine):
    spent = {"admit": 0.0, "launch": 0.0, "collect": 0.0}
    for name in spent:
        original = getattr(engine, f"_{name}")

        def wrapper(*args, _orig=original, _name=name):
            start = time.perf_counter()
            try:
                return _orig(*args)
            finally:
                spent[_name] += time.perf_counter() - start
        setattr(engine, f"_{name}", wrapper)
    return spent


def timed_run(engine, spent: dict, run, profiled: bool):
    """(wall seconds, run()'s result, the cProfile.Profile or None) of one call of `run`, with the
    step parts in `spent` (timed_parts) zeroed first and the device idle at the start."""
    for k in spent:
        spent[k] = 0.0
    profile = cProfile.Profile() if profiled else None
    if engine.device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    if profile:
        profile.enable()
    result = run()
    if profile:
        profile.disable()
    return time.perf_counter() - start, result, profile


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--configs", nargs="+", default=["ar,1", "ddtree,32", "ddtree,auto"])
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    prompts = demo_prompts(args.prompts)
    engine = Engine.from_pretrained(max_batch=args.batch, max_budget=64, kept_costs="off")
    engine.measure_round_costs()
    spent = timed_parts(engine)
    report = []
    for config in args.configs:
        mode, budget = config.split(",")
        budget, _, forced = budget.partition("@")  # ddtree,auto@0: auto requests with the size forced to 0
        budget = budget if budget == "auto" else int(budget)
        engine.sizer.forced = int(forced) if forced else None
        engine.generate(prompts, 128, mode=mode, budget=budget)
        for profiled in (False, True):  # the wall time without cProfile's cost, then where it goes
            graphs = engine.graphs
            eager, replays = (graphs.eager_rounds, graphs.replays) if graphs else (0, 0)
            wall, outs, profile = timed_run(engine, spent, lambda: engine.generate(prompts, 128, mode=mode, budget=budget),
                                            profiled)
            rounds = sum(o.stats.rounds for o in outs)
            gpu = sum(sum(v for k, v in o.stats.stage_seconds.items() if k != "prefill") for o in outs)
            line = (f"{config}{' (cProfile)' if profiled else ''}: wall {wall * 1e3:.0f} ms, admit {spent['admit'] * 1e3:.0f}, "
                    f"launch {spent['launch'] * 1e3:.0f}, collect {spent['collect'] * 1e3:.0f}; request-rounds {rounds}, "
                    f"GPU ms per request-round {gpu / rounds * 1e3:.3f}; eager rounds "
                    f"{graphs.eager_rounds - eager if graphs else 'all'}, replays {graphs.replays - replays if graphs else 0}, "
                    f"graphs {graphs.captures if graphs else 0}")
            print(line, flush=True)
            if profiled:
                pstats.Stats(profile).sort_stats("tottime").print_stats(18)
            report.append(line)
    print("\n".join(report))


if __name__ == "__main__":
    main()
