"""Host microseconds of an engine step, device work left out: the demo pair's engine on the CPU
with its rounds replaced by a canned result (a plain step commits one token, a tree round
--accepted tokens along its first nodes), so what is timed is the host's part of a step (plan,
sizer, launch bookkeeping, commit, detokenize, stream): `ar` beside budget="auto" on plain steps (a
cost table in which trees never pay), ddtree 8 beside budget="auto" on trees (a table in which
size 8 pays most), and auto's plain steps forced with their rows set aside or left out.

    python dev/host_step_cost.py --batch 1 8 32
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time
from collections import Counter
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from ddtree import Engine, SamplingParams  # noqa: E402
from ddtree.engine.costs import RoundCosts  # noqa: E402
from ddtree.engine.round import result_width  # noqa: E402


def canned_rounds(engine: Engine, accepted: int):
    def round_(table, plan, timer=None):
        width = result_width(engine.max_depth, engine.moe_layers if plan.experts else 0, plan.paths)
        result = torch.full((plan.bucket, width), -1, dtype=torch.int64)
        commits = 1 if plan.budget == 0 else accepted
        result[:, 0] = commits
        result[:, 1 : 1 + commits] = 7
        if plan.experts:
            result[:, 2 + engine.max_depth : 2 + engine.max_depth + engine.moe_layers] = 2
        if plan.paths:
            first = width - engine.max_depth - 1
            result[:, first : first + commits] = torch.arange(commits)
        return result
    return round_


def cost_table(engine: Engine, batch: int, trees_pay: bool) -> RoundCosts:
    """Seconds per step by bucket and size: plain steps cheap, or size 8 the cheapest tree by far."""
    def cost(size: int) -> float:
        if trees_pay:
            return 1e-3 if size == 8 else 1.0
        return 1e-3 if size == 0 else 1.0
    return RoundCosts(engine.signature, {b: {s: cost(s) for s in engine.sizer.sizes} for b in (1, 2, 4, 8, 16, 32)
                                         if b <= batch})


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--accepted", type=int, default=4, help="tokens a canned tree round commits")
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    for batch in args.batch:
        engine = Engine.from_pretrained(device="cpu", max_batch=batch, max_budget=64, kept_costs="off")
        engine.worker.round = canned_rounds(engine, args.accepted)
        for mode in ("ar", "auto", "ddtree8", "auto-trees", "plain-aside", "plain-out") * 2:
            engine.sizer.costs = cost_table(engine, batch, trees_pay=mode == "auto-trees")
            # auto's plain steps forced, their rows set aside for the drafter or left out
            engine.sizer.forced = 0 if mode.startswith("plain") else None
            engine.sizer.forced_set_aside = mode == "plain-aside"
            params = SamplingParams(max_new_tokens=args.accepted * (args.steps + 50), ignore_eos=True)
            ids = [engine.add_request([5 + i, 9, 11], params, mode="ar" if mode == "ar" else "ddtree",
                                      budget={"ar": 1, "ddtree8": 8}.get(mode, "auto")) for i in range(batch)]
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
            sizes = Counter(s for request_id in ids for s in engine._requests[request_id].stats.tree_sizes[-args.steps:])
            for request_id in ids:
                engine.abort(request_id)
            engine.drain()
            print(f"B = {batch} {mode:10s}: {seconds * 1e6:.1f} us of host time a step (sizes {dict(sizes)})", flush=True)
            if profile:
                pstats.Stats(profile).sort_stats("tottime").print_stats(12)


if __name__ == "__main__":
    main()
