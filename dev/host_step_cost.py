"""Host microseconds of an engine step, device work left out: the demo pair's engine on the CPU
with its rounds replaced by a canned result (every slot commits one token), so what is timed is
the host's part of a step (plan, sizer, launch bookkeeping, commit, detokenize, stream) for `ar`
and for budget="auto" on plain steps (a cost table in which trees never pay).

    python dev/host_step_cost.py --batch 8 32
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from ddtree import Engine, SamplingParams  # noqa: E402
from ddtree.engine.costs import RoundCosts  # noqa: E402
from ddtree.engine.round import result_width  # noqa: E402


def canned_rounds(engine: Engine):
    def round_(table, plan, timer=None):
        width = result_width(engine.max_depth, engine.moe_layers if plan.experts else 0, plan.paths)
        result = torch.full((plan.bucket, width), -1, dtype=torch.int64)
        result[:, 0], result[:, 1] = 1, 7
        if plan.experts:
            result[:, 2 + engine.max_depth : 2 + engine.max_depth + engine.moe_layers] = 2
        if plan.paths:
            result[:, width - engine.max_depth - 1] = 0
        return result
    return round_


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    for batch in args.batch:
        engine = Engine.from_pretrained(device="cpu", max_batch=batch, max_budget=64, kept_costs="off")
        sizes = engine.sizer.sizes
        engine.sizer.costs = RoundCosts(engine.signature, {b: {s: 1e-3 if s == 0 else 1.0 for s in sizes}
                                                           for b in (1, 2, 4, 8, 16, 32) if b <= batch})
        engine.worker.round = canned_rounds(engine)
        for mode in ("ar", "auto", "ar", "auto"):
            params = SamplingParams(max_new_tokens=args.steps + 50, ignore_eos=True)
            ids = [engine.add_request([5 + i, 9, 11], params, mode="ar" if mode == "ar" else "ddtree",
                                      budget=1 if mode == "ar" else "auto") for i in range(batch)]
            for _ in range(20):
                engine.step()
            profile = cProfile.Profile() if args.profile else None
            start = time.perf_counter()
            if profile:
                profile.enable()
            for _ in range(args.steps):
                engine.step()
            if profile:
                profile.disable()
            seconds = (time.perf_counter() - start) / args.steps
            for request_id in ids:
                engine.abort(request_id)
            engine.drain()
            print(f"B = {batch} {mode:5s}: {seconds * 1e6:.1f} us of host time a step", flush=True)
            if profile:
                pstats.Stats(profile).sort_stats("tottime").print_stats(12)


if __name__ == "__main__":
    main()
