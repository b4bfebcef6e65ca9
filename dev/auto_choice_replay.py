"""Replay budget="auto"'s choices offline, on rounds of the demo pair logged once.

    python dev/auto_choice_replay.py record --prompts 48 --out /tmp/rounds.json    # CPU, a few minutes
    python dev/auto_choice_replay.py replay --rounds /tmp/rounds.json \
        --costs benchmarks/results/auto_budget-demo-nvidia-h200.json --plain-ratio 1.28

record: every round a tree of 64 (the largest auto size), its nodes' path log-probs and the
accepted path, per request; a tree of the first n nodes in pop order would have committed the
accepted nodes numbered <= n, so one log answers for every size. replay: the engine's TreeSizer
chooses each round from what it read so far (a plain step reads nothing; the next logged round
stands for the next context), at the B = 1 costs of an auto_budget result file (plain steps times
--plain-ratio: what the H200's steps measured over its table); it prints tokens per ms beside
every fixed size. A proxy for choosing, not a measurement of speed: it leaves out how a plain
step changes the next context.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from ddtree.engine.costs import RoundCosts, StepCorrection  # noqa: E402
from ddtree.engine.forecast import RequestForecast  # noqa: E402
from ddtree.engine.sizing import DEFAULT_TREE_SIZES, TreeSizer  # noqa: E402

LARGEST = DEFAULT_TREE_SIZES[-1]


def record(args) -> None:
    import torch

    from ddtree import Engine

    torch.set_num_threads(args.threads)
    lines = (ROOT / "benchmarks/data/demo_prompts.jsonl").read_text().splitlines()
    prompts = [json.loads(line)["prompt"] for line in lines][: args.prompts]
    engine = Engine.from_pretrained(device=args.device, max_batch=1, max_budget=LARGEST)
    sizer = engine.sizer
    sizer.costs = RoundCosts(engine.signature, {1: {s: 1.0 for s in sizer.sizes}})  # never measured: unused
    sizer.choose = lambda bucket, auto, fixed, floor: LARGEST
    log, observe = [], sizer.forecast.observe

    def logged(forecasts, path_fixed, verified, accepted, accept_len):
        log.append((path_fixed[0].tolist(), accepted[0].tolist(), int(accept_len[0])))
        return observe(forecasts, path_fixed, verified, accepted, accept_len)

    sizer.forecast.observe = logged
    requests = []
    for prompt in prompts:
        log.clear()
        engine.generate([prompt], max_new_tokens=args.new, temperature=0.0)
        requests.append(list(log))
    args.out.write_text(json.dumps({"max_depth": engine.max_depth, "requests": requests}))
    print(f"{len(requests)} requests, {sum(map(len, requests))} rounds -> {args.out}")


def committed(accepted: list[int], accept_len: int, size: int) -> int:
    """Tokens the tree of the first `size` nodes would have committed (0: a plain step's 1)."""
    return 1 + sum(1 for node in accepted[1:accept_len] if 1 <= node <= size)


class Logged:
    def __init__(self):
        self.forecast = RequestForecast()

    def remaining_tokens(self) -> int:
        return 1 << 30


def replay(args) -> None:
    data = json.loads(args.rounds.read_text())
    depth, requests = data["max_depth"], data["requests"]
    rows = json.loads(args.costs.read_text())["rows"]
    table = next(r["round_costs_ms"] for r in rows if r["batch"] == 1 and "round_costs_ms" in r)["1"]
    seconds = {int(s): ms * 1e-3 * (args.plain_ratio if s == "0" else 1.0) for s, ms in table.items()}
    sizes = sorted(seconds)
    for size in sizes:
        tokens = sum(committed(a, n, size) if size else 1 for req in requests for _, a, n in req)
        print(f"fixed {size:3d}: {tokens / (sum(map(len, requests)) * seconds[size] * 1e3):.3f} tokens/ms")
    sizer = TreeSizer(tuple(s for s in sizes if s), depth, RoundCosts({}, {1: seconds}))
    sizer.correction = StepCorrection(limits=(1.0, 1.0))  # the costs are given: nothing to learn
    tokens = spent = 0.0
    chosen: dict[int, int] = {}
    for req in requests:
        request = Logged()
        for path, accepted, accept_len in req:
            size = sizer.choose(1, [request], 0.0, 0)
            chosen[size] = chosen.get(size, 0) + 1
            spent += seconds[size]
            tokens += committed(accepted, accept_len, size)
            if size:
                kept = [0] + [x for x in accepted[1:accept_len] if 1 <= x <= size]
                n = len(kept)
                sizer.forecast.observe([request.forecast], np.array([path]), size,
                                       np.array([kept + [-1] * (depth + 1 - n)]), np.array([n]))
    print(f"auto     : {tokens / (spent * 1e3):.3f} tokens/ms, sizes chosen {dict(sorted(chosen.items()))}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    rec = sub.add_parser("record")
    rec.add_argument("--prompts", type=int, default=48)
    rec.add_argument("--new", type=int, default=128)
    rec.add_argument("--device", default="cpu")
    rec.add_argument("--threads", type=int, default=2)
    rec.add_argument("--out", type=Path, required=True)
    rep = sub.add_parser("replay")
    rep.add_argument("--rounds", type=Path, required=True)
    rep.add_argument("--costs", type=Path, default=ROOT / "benchmarks/results/auto_budget-demo-nvidia-h200.json")
    rep.add_argument("--plain-ratio", type=float, default=1.0)
    args = parser.parse_args()
    record(args) if args.command == "record" else replay(args)


if __name__ == "__main__":
    main()
