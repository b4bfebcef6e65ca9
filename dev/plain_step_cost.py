"""What auto's plain step costs beside `ar`'s, and which part: the demo pair on a GPU, per batch B,
the device time (CUDA events) and wall time per step of
  ar            mode "ar" (no drafter work at all)
  auto@0        budget "auto" forced to plain steps: rows set aside, appended every PENDING_ROWS
  auto@0 kept   the same with the set-aside buffer large enough that no append runs in the pass
                (PENDING_ROWS patched before the engine is built): the set-aside alone
  auto@0 out    plain steps that leave their rows out of the drafter's context (auto's plain
                steps far from the next tree, engine/sizing.py)
after a warm-up pass of the same prompts (graphs captured).

    python dev/plain_step_cost.py --batches 1 8 32
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "dev"))

import ddtree.engine.batch as batch_module  # noqa: E402
import ddtree.engine.scheduling as scheduling_module  # noqa: E402
from ddtree import Engine  # noqa: E402
from demo_step_profile import demo_prompts  # noqa: E402


def timed(engine, prompts, mode, budget, new):
    engine.generate(prompts, new, mode=mode, budget=budget)  # warm-up: compile, capture
    torch.cuda.synchronize()
    start = time.perf_counter()
    outs = engine.generate(prompts, new, mode=mode, budget=budget)
    wall = time.perf_counter() - start
    steps = max(o.stats.rounds for o in outs) * -(-len(prompts) // engine.max_batch)
    device = sum(sum(v for k, v in o.stats.stage_seconds.items() if k != "prefill") for o in outs)
    rounds = sum(o.stats.rounds for o in outs)
    return {"wall_ms_per_step": wall / steps * 1e3, "device_ms_per_step": device / rounds * 1e3 * 1.0}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--new", type=int, default=128)
    args = parser.parse_args()
    prompts = demo_prompts()
    default_rows = batch_module.PENDING_ROWS
    for b in args.batches:
        for label, rows in (("ar", default_rows), ("auto@0", default_rows), ("auto@0 kept", 4 * args.new),
                            ("auto@0 out", default_rows)):
            batch_module.PENDING_ROWS = scheduling_module.PENDING_ROWS = rows
            engine = Engine.from_pretrained(max_batch=b, max_budget=64, kept_costs="off")
            engine.sizer.forced = 0  # no cost measurement, every auto step plain
            engine.sizer.forced_set_aside = label != "auto@0 out"
            mode, budget = ("ar", 1) if label == "ar" else ("ddtree", "auto")
            got = timed(engine, prompts[: 2 * b], mode, budget, args.new)
            print(f"B={b} {label:12s} device {got['device_ms_per_step']:.4f} ms/step, wall {got['wall_ms_per_step']:.4f} ms/step",
                  flush=True)
            del engine
            torch.cuda.empty_cache()
    batch_module.PENDING_ROWS = scheduling_module.PENDING_ROWS = default_rows


if __name__ == "__main__":
    main()
