"""Kernel-level profile of one engine round replayed from its CUDA graph (torch.profiler, CUDA):
the `ar` step or a ddtree round of engine_round.py's random pair, with everything the round runs
besides the forward (metadata, sampling, commit, experts touched). Replay time and kernel table.

    python benchmarks/profile_round.py --config moonlight-16b-a3b --batch 1 --budget 0

--kernels compares model paths in one run (kernel policies, ops/policy.py): "auto" (Triton
kernels on CUDA, the default) and "reference" (PyTorch paths). Writes
profile_round-<config>-b<B>-<ar|budget<N>>-<gpu>.{json,md}. "Kernels" counts every GPU activity the
profiler records in the replays (kernels, memcpy, memset), names cut at 120 characters.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import environment, markdown_table, write_results  # noqa: E402
from round_setup import PrefixBatch, build_pair  # noqa: E402

from ddtree.engine.round import RoundPlan, run_round  # noqa: E402
from ddtree.engine.timing import StageTimer  # noqa: E402
from ddtree.ops import PATHS, KernelPolicy, apply_policy  # noqa: E402


def capture(pb: PrefixBatch, run) -> torch.cuda.CUDAGraph:
    """restore + one round, warmed up on a side stream, then captured."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        pb.restore()
        run()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        pb.restore()
        run()
    torch.cuda.synchronize()
    return graph


def replay_ms(graph: torch.cuda.CUDAGraph, repeats: int) -> list[float]:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(3):
        graph.replay()
    samples = []
    for _ in range(repeats):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end))
    return samples


def kernel_table(graph: torch.cuda.CUDAGraph, replays: int) -> list[tuple[str, float, float]]:
    """(kernel name, launches per round, us per round), costliest first."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graph.replay()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
    rows = [(e.key[:120], e.count / replays, e.device_time_total / replays) for e in events]
    return sorted(rows, key=lambda r: -r[2])


@torch.no_grad()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="moonlight-16b-a3b")
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--budget", type=int, default=0, help="tree nodes per request; 0: the ar step")
    parser.add_argument("--prefix", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=30, help="timed replays")
    parser.add_argument("--kernels", nargs="+", default=["auto"], choices=PATHS)
    parser.add_argument("--no-pdl", action="store_true",
                        help="launch without programmatic dependent launch, so that kernel times do not overlap")
    parser.add_argument("--out", type=Path, default=None, help="results folder (default benchmarks/results)")
    args = parser.parse_args()
    device = torch.device("cuda")
    target, drafter, _, _ = build_pair(args.config, args.layers, device)
    pb = PrefixBatch(target, drafter, args.batch, args.prefix, args.budget + 1)
    pb.set_budget(args.budget)
    plan = RoundPlan(bucket=args.batch, budget=args.budget, k=min(args.budget, target.cfg.vocab_size), any_sampled=False,
                     any_filtered=False, key_limit=pb.key_limit if args.budget else None, features=args.budget > 0,
                     experts=True)
    summary = {}
    for choice in args.kernels:
        policy = KernelPolicy(choice, pdl=not args.no_pdl)
        apply_policy(target, policy)
        apply_policy(drafter, policy)
        graph = capture(pb, lambda: run_round(pb.ctx, pb.state, plan, pb.max_depth, StageTimer(device, enabled=False)))
        samples = replay_ms(graph, args.repeats)
        rows = kernel_table(graph, 5)
        summary[choice] = {"replay_ms_median": statistics.median(samples), "replay_ms_min": min(samples),
                           "replay_ms_max": max(samples), "kernels_per_round": sum(r[1] for r in rows),
                           "kernel_us_per_round": sum(r[2] for r in rows),
                           "by_name": [{"name": n, "per_round": c, "us_per_round": t} for n, c, t in rows]}
        print(f"{choice}: replay {summary[choice]['replay_ms_median']:.3f} ms (median of {args.repeats}); "
              f"{summary[choice]['kernels_per_round']:.0f} kernels, {summary[choice]['kernel_us_per_round'] / 1e3:.3f} ms "
              f"of kernel time", flush=True)
        del graph
    mode = "ar" if args.budget == 0 else f"budget{args.budget}"
    payload = {"environment": environment(), "config": args.config, "layers": target.cfg.num_hidden_layers,
               "batch": args.batch, "budget": args.budget, "prefix": args.prefix, "repeats": args.repeats,
               "pdl": not args.no_pdl, "paths": summary}
    path = write_results(f"profile_round-{args.config}-b{args.batch}-{mode}", payload, tables(summary, args), args.out)
    print(path.read_text())


def tables(summary: dict, args) -> str:
    parts = []
    if not args.no_pdl:
        parts.append("Programmatic dependent launch on (ops/launch.py): a kernel's time includes its wait for the one "
                     "before it, so the times overlap and sum to more than the replay; --no-pdl gives times that add up.")
    for choice, s in summary.items():
        rows = [[f"{r['us_per_round']:.1f}", f"{r['per_round']:.0f}", r["name"][:90]] for r in s["by_name"][:25]]
        parts.append(f"### kernel paths {choice}: B = {args.batch}, {'ar step' if args.budget == 0 else f'budget {args.budget}'}, "
                     f"prefix {args.prefix}. Graph replay {s['replay_ms_median']:.3f} ms (median of {args.repeats}; "
                     f"{s['replay_ms_min']:.3f} to {s['replay_ms_max']:.3f}); {s['kernels_per_round']:.0f} kernels, "
                     f"{s['kernel_us_per_round'] / 1e3:.3f} ms of kernel time per round\n\n"
                     + markdown_table(["us per round", "launches", "kernel"], rows))
    return "\n\n".join(parts)


if __name__ == "__main__":
    main()
