"""budget="auto" against fixed budgets on the demo pair, on the CPU, with a device's cost table.

The demo pair runs for real (float32, its own acceptance); each launched round's time is taken
from a cost table measured on a GPU (auto_budget's JSON, `round_costs_ms`) at the round's bucket
and size instead of the CPU's clock, and the sizer's correction is off. So this shows what auto's
choices are worth at that device's costs, with no device: tokens per table-millisecond of auto
beside ar and every fixed budget, prefills left out. --schedule continuous runs every prompt
through one generate at max_batch B (a finished request's slot refilled at once), as
auto_budget's does; groups runs groups of B.

    python dev/auto_sim.py --costs benchmarks/results/auto_budget-demo-nvidia-h200.json --batches 1 8
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "dev"))

from ddtree import Engine  # noqa: E402
from ddtree.engine.costs import RoundCosts, StepCorrection  # noqa: E402
from demo_step_profile import demo_prompts  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--costs", type=Path, required=True, help="an auto_budget JSON with round_costs_ms")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--prompts", type=int, default=16, help="prompts per batch size")
    parser.add_argument("--new", type=int, default=128)
    parser.add_argument("--budgets", type=int, nargs="+", default=[4, 8, 16, 32, 64])
    parser.add_argument("--only", nargs="+", help="run only these configurations (ar, 'ddtree 8', auto)")
    parser.add_argument("--schedule", choices=("groups", "continuous"), default="groups")
    args = parser.parse_args()
    torch.set_flush_denormal(True)
    rows = json.loads(args.costs.read_text())["rows"]
    measured = next(r["round_costs_ms"] for r in rows if "round_costs_ms" in r and r["batch"] == max(args.batches))
    prompts = demo_prompts()
    for batch in args.batches:
        engine = Engine.from_pretrained(device="cpu", max_batch=batch, max_budget=max(args.budgets), kept_costs="off")
        seconds = {int(b): {int(s): t / 1e3 for s, t in row.items()} for b, row in measured.items() if int(b) <= batch}
        chosen = prompts[: args.prompts]
        groups = [chosen[i : i + batch] for i in range(0, len(chosen), batch)] if args.schedule == "groups" else [chosen]
        configs = [("ar", "ar", 1)] + [(f"ddtree {b}", "ddtree", b) for b in args.budgets] + [("auto", "ddtree", "auto")]
        configs = [c for c in configs if not args.only or c[0] in args.only]
        clock, sizes = [], Counter()
        round_ = engine.worker.round

        def timed(table, plan, timer=None):
            clock.append(engine.sizer.costs.cost(plan.bucket, plan.budget))
            sizes[plan.budget] += 1
            return round_(table, plan, timer)

        engine.worker.round = timed
        print(f"B = {batch} ({args.schedule}):")
        for label, mode, budget in configs:
            engine.sizer.costs = RoundCosts(engine.signature, {b: dict(r) for b, r in seconds.items()})
            engine.sizer.correction = StepCorrection(limits=(1.0, 1.0))  # the table is the clock
            for warm in (True, False):  # auto learns in the first pass, as a server that has been up
                tokens = 0
                clock.clear()
                sizes.clear()
                for group in groups:
                    outs = engine.generate(group, max_new_tokens=args.new, mode=mode, budget=budget)
                    tokens += sum(len(o.token_ids) - 1 for o in outs)
            print(f"  {label:10s} {tokens / (sum(clock) * 1e3):7.2f} tokens/ms  rounds by size {dict(sorted(sizes.items()))}",
                  flush=True)

if __name__ == "__main__":
    main()
