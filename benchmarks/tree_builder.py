"""Draft-tree builder and top-k: Triton on the GPU vs the heapq reference, top-k vs its memory floor.

    python benchmarks/tree_builder.py            # full grid on CUDA; a small CPU run otherwise
    python benchmarks/tree_builder.py --out DIR  # write results elsewhere

Builder: B in {1, 8, 64, 256} x budget in {16, 64, 256, 512}, D = 15. The Triton launch is timed by
CUDA-graph replay (median of 30 trials of 20 launches); the reference (ddtree.tree.reference, a
Python heapq loop, including its device-to-host copy) by wall clock, median of a few runs. Every
timed Triton output is also compared bit for bit with the reference.
Top-k: topk_logprobs on bf16 logits, V = 163840 (Kimi K2), timed by CUDA-graph replay against the
memory floor (logit bytes / measured copy bandwidth) and against plain log_softmax + torch.topk.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import environment, markdown_table, measure_ceilings, time_graph_us, write_results  # noqa: E402

from ddtree.tree import TREE_FIELDS, topk_logprobs  # noqa: E402
from ddtree.tree.reference import build_trees_reference  # noqa: E402

DEPTH = 15
VOCAB_KIMI = 163840


def draft_inputs(batch: int, budget: int, device: str, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k of random bf16 drafter logits (bf16 makes ties common, as in real drafts)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    logits = (torch.randn(batch, DEPTH, 4096, device=device, generator=gen) * 3).bfloat16()
    return topk_logprobs(logits, budget)


def wall_median_us(fn, repeats: int) -> float:
    samples = []
    for _ in range(repeats):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1e6)
    return statistics.median(samples)


def bench_builder(device: str, batches, budgets, warps_sweep) -> list[dict]:
    rows = []
    for batch in batches:
        for budget in budgets:
            lp, tok = draft_inputs(batch, budget, device, seed=batch * 1000 + budget)
            ref = build_trees_reference(lp, tok, budget)
            repeats = 5 if batch * budget <= 4096 else 3
            row = {"B": batch, "budget": budget, "D": DEPTH,
                   "reference_us": wall_median_us(lambda: build_trees_reference(lp, tok, budget), repeats)}
            if device == "cuda":
                from ddtree.tree.build_triton import build_trees_triton, default_num_warps

                out = build_trees_triton(lp, tok, budget)
                row["bit_exact"] = all(torch.equal(getattr(out, f), getattr(ref, f)) for f in TREE_FIELDS)
                sweep = {}
                for warps in warps_sweep:
                    sweep[warps] = time_graph_us(lambda w=warps: build_trees_triton(lp, tok, budget, num_warps=w))
                default = default_num_warps(triton.next_power_of_2(budget))
                row["triton_us"] = sweep[default]
                row["default_num_warps"] = default
                row["triton_us_by_num_warps"] = sweep
                row["speedup"] = row["reference_us"] / row["triton_us"]
            rows.append(row)
            print(row, flush=True)
    return rows


def bench_topk(device: str, batches, ks, ceilings: dict | None) -> list[dict]:
    rows = []
    for batch in batches:
        gen = torch.Generator(device=device).manual_seed(batch)
        logits = torch.randn(batch, DEPTH, VOCAB_KIMI, device=device, generator=gen).bfloat16()
        for k in ks:
            row = {"B": batch, "D": DEPTH, "V": VOCAB_KIMI, "k": k, "logit_bytes": logits.numel() * logits.element_size()}
            ours = lambda: topk_logprobs(logits, k)  # noqa: E731
            plain = lambda: torch.log_softmax(logits.float(), -1).topk(k, dim=-1)  # noqa: E731
            if device == "cuda":  # graph replay: GPU time, without the host's launch gaps
                row["topk_logprobs_us"] = time_graph_us(ours, launches_per_graph=3, trials=20)
                row["log_softmax_topk_us"] = time_graph_us(plain, launches_per_graph=3, trials=20)
                floor_us = row["logit_bytes"] / (ceilings["copy_bandwidth_GBps"] * 1e3)
                row["memory_floor_us"] = floor_us
                row["x_floor"] = row["topk_logprobs_us"] / floor_us
            else:
                row["topk_logprobs_us"] = wall_median_us(ours, 3)
                row["log_softmax_topk_us"] = wall_median_us(plain, 3)
            rows.append(row)
            print(row, flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=None, help="results folder (default benchmarks/results)")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    env = environment()
    if device == "cuda":
        ceilings = measure_ceilings()
        builder = bench_builder(device, (1, 8, 64, 256), (16, 64, 256, 512), (1, 2, 4, 8))
        topk = bench_topk(device, (1, 8, 64), (64, 512), ceilings)
    else:  # Triton needs a GPU here: time what runs on the CPU, on a smaller grid.
        ceilings = None
        builder = bench_builder(device, (1, 8), (16, 64), ())
        topk = bench_topk(device, (1,), (64,), None)

    headers = ["B", "budget", "reference (us)"]
    if device == "cuda":
        headers += ["triton (us)", "speedup", "bit-exact"]
    brows = []
    for r in builder:
        cells = [r["B"], r["budget"], f"{r['reference_us']:.0f}"]
        if device == "cuda":
            cells += [f"{r['triton_us']:.1f}", f"{r['speedup']:.0f}x", r["bit_exact"]]
        brows.append(cells)
    theaders = ["B", "k", "logits (MB)", "topk_logprobs (us)", "log_softmax+topk (us)"]
    if device == "cuda":
        theaders += ["memory floor (us)", "x floor"]
    trows = []
    for r in topk:
        cells = [r["B"], r["k"], f"{r['logit_bytes'] / 1e6:.1f}", f"{r['topk_logprobs_us']:.0f}", f"{r['log_softmax_topk_us']:.0f}"]
        if device == "cuda":
            cells += [f"{r['memory_floor_us']:.1f}", f"{r['x_floor']:.1f}"]
        trows.append(cells)
    ceil_md = ""
    if ceilings:
        ceil_md = (f"Measured ceilings: copy {ceilings['copy_bandwidth_GBps']:.0f} GB/s (read + write), "
                   f"bf16 matmul {ceilings['bf16_matmul_TFLOPs']:.0f} TFLOP/s.\n\n")
    table = (ceil_md + f"## Draft-tree builder (D = {DEPTH})\n\n" + markdown_table(headers, brows)
             + f"\n\n## topk_logprobs (bf16 logits, D = {DEPTH}, V = {VOCAB_KIMI})\n\n" + markdown_table(theaders, trows))
    payload = {"environment": env, "ceilings": ceilings, "builder": builder, "topk": topk}
    path = write_results("tree_builder", payload, table, args.out)
    print(table)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
