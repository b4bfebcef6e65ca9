"""budget="auto" against fixed budgets on the demo pair, on the CPU, with a device's cost table.

The demo pair runs for real (float32, its own acceptance); each round's time is taken from a
cost table measured on a GPU (auto_budget's JSON, `round_costs_ms`) instead of the CPU's clock,
and the sizer's correction is off. So this shows what auto's choices are worth at that device's
costs, with no device: tokens per table-millisecond of auto beside ar and every fixed budget.

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

from ddtree import Engine  # noqa: E402
from ddtree.engine.costs import RoundCosts, StepCorrection  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--costs", type=Path, required=True, help="an auto_budget JSON with round_costs_ms")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--prompts", type=int, default=16, help="prompts per batch size")
    parser.add_argument("--new", type=int, default=128)
    parser.add_argument("--budgets", type=int, nargs="+", default=[4, 8, 16, 32, 64])
    parser.add_argument("--only", nargs="+", help="run only these configurations (ar, 'ddtree 8', auto)")
    args = parser.parse_args()
    torch.set_flush_denormal(True)
    rows = json.loads(args.costs.read_text())["rows"]
    measured = next(r["round_costs_ms"] for r in rows if "round_costs_ms" in r and r["batch"] == max(args.batches))
    prompts = [json.loads(line)["prompt"] for line in (ROOT / "benchmarks/data/demo_prompts.jsonl").read_text().splitlines()]
    for batch in args.batches:
        engine = Engine.from_pretrained(device="cpu", max_batch=batch, max_budget=max(args.budgets), kept_costs="off")
        seconds = {int(b): {int(s): t / 1e3 for s, t in row.items()} for b, row in measured.items() if int(b) <= batch}
        chosen = prompts[: args.prompts]
        groups = [chosen[i : i + batch] for i in range(0, len(chosen), batch)]
        configs = [("ar", "ar", 1)] + [(f"ddtree {b}", "ddtree", b) for b in args.budgets] + [("auto", "ddtree", "auto")]
        configs = [c for c in configs if not args.only or c[0] in args.only]
        print(f"B = {batch}:")
        for label, mode, budget in configs:
            engine.sizer.costs = RoundCosts(engine.signature, {b: dict(r) for b, r in seconds.items()})
            engine.sizer.correction = StepCorrection(limits=(1.0, 1.0))  # the table is the clock
            for warm in (True, False):  # auto learns in the first pass, as a server that has been up
                tokens, ms, sizes = 0, 0.0, Counter()
                for group in groups:
                    outs = engine.generate(group, max_new_tokens=args.new, mode=mode, budget=budget)
                    rounds = max(o.stats.rounds for o in outs)
                    per_round = [max((o.stats.tree_sizes[i] for o in outs if i < o.stats.rounds), default=0)
                                 for i in range(rounds)]
                    bucket = min(b for b in seconds if b >= len(group))
                    ms += sum(engine.sizer.costs.cost(bucket, s) for s in per_round) * 1e3
                    tokens += sum(len(o.token_ids) - 1 for o in outs)
                    sizes.update(per_round)
            print(f"  {label:10s} {tokens / ms:7.2f} tokens/ms  sizes {dict(sorted(sizes.items()))}", flush=True)


if __name__ == "__main__":
    main()
