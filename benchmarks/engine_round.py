"""One engine round, stage by stage, against floors; and end-to-end tokens/s at forced acceptance.

    python benchmarks/engine_round.py --config moonlight-16b-a3b               # all 27 layers
    python benchmarks/engine_round.py --config kimi-k2 --layers 4              # + totals scaled to 61 layers
    python benchmarks/engine_round.py --config moonlight-16b-a3b --quick       # a GPU smoke run
    python benchmarks/engine_round.py --config tiny --device cpu --quick       # a CPU smoke run, seconds

Pair (round_setup.py): the config's target with random weights made on the device, changed so its
greedy next token is a fixed permutation of the current one (so acceptance can be forced in bf16),
and a random DFlash drafter of matching width (5 layers, block 16). For every B and budget (and
ar, budget 0), B requests hold a committed prefix (random cache entries) and run_round runs the
same round again and again, its state restored before each repeat: per stage with the engine's
StageTimer (eager, CUDA events), and whole, replayed from a CUDA graph captured around restore +
run_round (per-stage times from in-graph events where the driver allows). Each stage's floor is
max(bytes / copy bandwidth, FLOPs / matmul rate) with both ceilings measured in this run
(round_floors.py states the formulas); routed experts are counted from the verify's router ids.
Then the engine end to end (round_e2e.py): tokens/s of ar, chain and ddtree at forced
acceptance lengths. Writes engine_round-<config>[-<L>l]-<gpu>.{json,md,png} under --out.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import environment, measure_ceilings, write_results  # noqa: E402
from round_e2e import __doc__ as E2E_NOTE, forced_acceptance  # noqa: E402
from round_floors import FORMULAS, LEGEND, ModelCounts, stage_floors, uniform_touched  # noqa: E402
from round_report import bars, markdown, measured, plot  # noqa: E402
from round_setup import PrefixBatch, build_pair  # noqa: E402
from round_timing import cpu_ceilings, routed_experts_union, spread, summarize, time_eager, time_graph  # noqa: E402

from ddtree.engine.round import RoundPlan, run_round  # noqa: E402
from ddtree.engine.timing import StageTimer  # noqa: E402
from ddtree.ops import PATHS, KernelPolicy, apply_policy  # noqa: E402

FULL = dict(prefix=1024, batches=[1, 8, 32], budgets=[16, 64], repeats=10, graph_repeats=30, warmup=2,
            e2e_batches=[1, 8], lengths=[2, 4, 6, 8], new_tokens=73)
QUICK = dict(prefix=256, batches=[1, 8], budgets=[64], repeats=3, graph_repeats=5, warmup=1,
             e2e_batches=[1, 8], lengths=[2, 8], new_tokens=17)
SCALED_NOTE = (
    "Scaled to {full} layers, not measured: each stage's measured median x (its floor for a {full}-layer model / its "
    "floor for these {layers} layers). The {full}-layer floor adds MoE layers like the last one here (routed experts "
    "touched per MoE layer as measured; the embedding, lm_head and first dense layers counted once), so the per-layer "
    "work scales linearly with the layer count and each stage keeps its measured / floor ratio. Stages that do not "
    "depend on the target's depth (draft, topk, build, accept) stay as measured.")


def parse(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="moonlight-16b-a3b", help="a name under benchmarks/configs/, or tiny")
    parser.add_argument("--layers", type=int, default=None, help="keep the first L decoder layers")
    parser.add_argument("--device", default="cuda", help="cpu: a smoke run (no graphs, CPU ceilings)")
    parser.add_argument("--quick", action="store_true", help="fewer shapes, repeats and tokens (defaults below)")
    parser.add_argument("--prefix", type=int, help=f"committed tokens per request ({FULL['prefix']}; quick {QUICK['prefix']})")
    parser.add_argument("--batches", type=int, nargs="+", help=f"B values ({FULL['batches']})")
    parser.add_argument("--budgets", type=int, nargs="+", help=f"tree budgets beside ar ({FULL['budgets']})")
    parser.add_argument("--repeats", type=int, help=f"timed eager rounds per shape ({FULL['repeats']})")
    parser.add_argument("--graph-repeats", type=int, help=f"timed graph replays per shape ({FULL['graph_repeats']})")
    parser.add_argument("--warmup", type=int, help=f"untimed eager rounds first ({FULL['warmup']})")
    parser.add_argument("--no-graph", action="store_true", help="eager timing only")
    parser.add_argument("--e2e-batches", type=int, nargs="*", help=f"B values end to end ({FULL['e2e_batches']}; none: skip)")
    parser.add_argument("--lengths", type=int, nargs="+", help=f"forced acceptance lengths ({FULL['lengths']})")
    parser.add_argument("--new-tokens", type=int, help=f"tokens per request end to end ({FULL['new_tokens']}: the "
                        "prefill's first, then 72, a multiple of every L, so every round commits exactly L)")
    parser.add_argument("--e2e-budget", type=int, default=64)
    parser.add_argument("--kernels", default="auto", choices=PATHS,
                        help="the pair's kernel policy: norm / MLA / router / MoE paths (ops/policy.py)")
    parser.add_argument("--eager-e2e", action="store_true", help="end to end without the engine's CUDA graphs")
    parser.add_argument("--out", type=Path, default=None, help="results folder (default benchmarks/results)")
    args = parser.parse_args(argv)
    for name, value in (QUICK if args.quick else FULL).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    return args


def time_cell(pb: PrefixBatch, target, counts: ModelCounts, batch: int, budget: int, args, ceilings, device) -> dict:
    """Everything measured for one (B, budget): eager and graph spreads, floors, experts touched."""
    vocab, depth = target.cfg.vocab_size, pb.max_depth
    plan = RoundPlan(bucket=batch, budget=budget, k=min(budget, vocab) if budget else 0, any_sampled=False,
                     any_filtered=False, key_limit=pb.key_limit if budget else None, features=budget > 0,
                     experts=counts.moe_layers > 0)
    pb.set_budget(budget)
    run = lambda timer: run_round(pb.ctx, pb.state, plan, depth, timer)  # noqa: E731
    result = []
    union = routed_experts_union(target, lambda: (pb.restore(), result.append(run(StageTimer(device, enabled=False)))))
    per_request = result[0][:, depth + 2 : depth + 2 + counts.moe_layers].float()
    cell = {"B": batch, "budget": budget, "mode": "ddtree" if budget else "ar", "prefix": args.prefix,
            "eager": summarize(time_eager(run, pb.restore, device, args.repeats, args.warmup)), "graph": None}
    if device.type == "cuda" and not args.no_graph:
        try:
            stages, totals = time_graph(run, pb.restore, args.graph_repeats)
            cell["graph"] = summarize(stages, totals) if stages else {"round": spread(totals)}
        except Exception as err:  # report and go on with eager numbers
            cell["graph_error"] = repr(err)
            print(f"  graph capture failed: {err!r}", flush=True)
            torch.cuda.synchronize()
    rows = batch * (budget + 1)
    cell["experts"] = {"union_per_moe_layer": union, "union_per_moe_layer_mean": sum(union) / max(1, len(union)),
                       "uniform_expectation_per_layer": uniform_touched(target.cfg, rows),
                       "per_request_mean": float(per_request.mean()) if per_request.numel() else 0.0}
    cell["floors"] = stage_floors(target.cfg, pb.ctx.drafter.cfg, counts, batch, budget, args.prefix, sum(union), ceilings)
    source, m = measured(cell)
    cell["measured_over_floor"] = {s: m[s]["median"] / cell["floors"][s]["floor_us"] for s in m}
    cell["measured_source"] = source
    return cell


def scale_cell(cell: dict, target, drafter, counts: ModelCounts, layers: int, args, ceilings) -> dict:
    """The cell at `layers` target layers: each stage's measured time x its floor there / its floor
    here (see SCALED_NOTE); the floors for the grown model use the same experts per MoE layer."""
    full = counts.with_layers(layers)
    touched = sum(cell["experts"]["union_per_moe_layer"]) * full.moe_layers / max(1, counts.moe_layers)
    floors = stage_floors(target.cfg, drafter.cfg, full, cell["B"], cell["budget"], args.prefix, touched, ceilings)
    source, m = measured(cell)
    stages = [s for s in m if s != "round"] or ["round"]
    grow = {s: floors[s]["floor_us"] / cell["floors"][s]["floor_us"] for s in stages}
    return {"layers": layers, "source": source, "growth": grow, "floor_round_us": floors["round"]["floor_us"],
            "measured_round_us": sum(m[s]["median"] * grow[s] for s in stages)}


def summary(cell: dict) -> str:
    source, m = measured(cell)
    stages = ", ".join(f"{s} {v['median'] / 1e3:.3f}" for s, v in m.items() if s != "round")
    return (f"B={cell['B']:3d} budget={cell['budget']:3d}: round {m['round']['median'] / 1e3:.3f} ms ({source}), eager "
            f"{cell['eager']['round']['median'] / 1e3:.3f} ms, floor {cell['floors']['round']['floor_us'] / 1e3:.3f} ms; {stages}")


@torch.no_grad()
def main(argv=None) -> Path:
    args = parse(argv)
    start = time.perf_counter()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("engine_round.py needs a CUDA GPU (--device cpu --config tiny for a smoke run)")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    ceilings = measure_ceilings() if device.type == "cuda" else cpu_ceilings()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    print(f"ceilings {ceilings}", flush=True)
    target, drafter, perm, info = build_pair(args.config, args.layers, device, dtype)
    for model in (target, drafter):
        apply_policy(model, KernelPolicy(args.kernels))
    counts = ModelCounts.of(target, drafter)
    pb = PrefixBatch(target, drafter, max(args.batches), args.prefix, max(args.budgets) + 1)
    full = info["published_layers"]
    cells = []
    for batch in args.batches:
        for budget in [0] + args.budgets:
            cell = time_cell(pb, target, counts, batch, budget, args, ceilings, device)
            if full != info["target_layers"]:
                cell["scaled"] = scale_cell(cell, target, drafter, counts, full, args, ceilings)
            cells.append(cell)
            print(f"[{time.perf_counter() - start:5.0f} s] {summary(cell)}", flush=True)
            if device.type == "cuda":
                torch.cuda.empty_cache()
    del pb
    e2e = []
    if args.e2e_batches:
        if device.type == "cuda":
            torch.cuda.empty_cache()
        print(f"[{time.perf_counter() - start:5.0f} s] end to end", flush=True)
        e2e = forced_acceptance(target, drafter, perm, batches=args.e2e_batches, lengths=args.lengths,
                                prefix=args.prefix, new=args.new_tokens, budget=args.e2e_budget,
                                cuda_graphs=device.type == "cuda" and not args.eager_e2e)
    setup = info | {"device": str(device), "dtype": str(dtype).removeprefix("torch."), "prefix": args.prefix,
                    "page_size": 64, "kernels": args.kernels, "repeats": args.repeats,
                    "graph_repeats": 0 if args.no_graph or device.type != "cuda" else args.graph_repeats,
                    "warmup": args.warmup, "state": PrefixBatch.__doc__.strip()}
    payload = {"environment": environment(), "config": args.config, "args": vars(args) | {"out": str(args.out)},
               "setup": setup, "ceilings": ceilings, "floor_formulas": FORMULAS, "floor_legend": LEGEND,
               "cells": cells, "bars": bars(cells), "e2e": e2e, "e2e_note": " ".join(E2E_NOTE.split())}
    if full != info["target_layers"]:
        payload["scaled_note"] = SCALED_NOTE.format(full=full, layers=info["target_layers"])
    name = f"engine_round-{args.config}" + (f"-{args.layers}l" if args.layers else "")
    name += "" if args.kernels == "auto" else f"-{args.kernels}"
    md = write_results(name, payload, markdown(payload), args.out)
    plot(payload, md.with_suffix(".png"))
    print(md.read_text(), flush=True)
    print(f"[{time.perf_counter() - start:5.0f} s] wrote {md}", flush=True)
    return md


if __name__ == "__main__":
    main()
