"""`ddtree profile`: measure what a step costs at every batch bucket and tree size for a model pair
on this device, and write the table as JSON for `--round-costs` (engine/costs.py)."""

from __future__ import annotations

import sys

from .arguments import add_pair_arguments, load_engine, positive, serving_batch


def add_profile_command(commands):
    p = commands.add_parser("profile", help="measure the round-cost table that budget auto uses (JSON for "
                            "--round-costs)")
    add_pair_arguments(p)
    p.add_argument("--out", required=True, help="the JSON file to write")
    p.add_argument("--prefix", type=positive(int), default=None,
                   help="prompt tokens of each stand-in request (default: min(256, max_model_len / 4))")
    p.add_argument("--repeats", type=positive(int), default=6, help="timed steps per shape and pass (median)")
    return p


def profile(args) -> None:
    args.max_batch = args.max_batch or serving_batch(args.device)
    engine = load_engine(args, kept_costs="fresh")  # measured here, whatever was kept (and kept again)
    if engine.sizer is None:
        raise ValueError("profiling measures tree rounds: name a --drafter with --target")
    costs = engine.measure_round_costs(progress=True, prefix=args.prefix, repeats=args.repeats)
    costs.save(args.out)
    sizes = engine.sizer.sizes
    print(f"round costs of {args.target or 'the demo pair'} on {costs.signature['device']} "
          f"(ms per step; size 0: a plain decode step) -> {args.out}", file=sys.stderr)
    print("bucket | " + " | ".join(str(s) for s in sizes))
    for bucket in costs.buckets():
        print(f"{bucket} | " + " | ".join(f"{costs.cost(bucket, s) * 1e3:.3f}" for s in sizes))
