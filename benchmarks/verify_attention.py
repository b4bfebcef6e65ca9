"""Tree-verify MLA attention on the GPU vs PyTorch SDPA with a dense mask, and vs the roofline.

    python benchmarks/verify_attention.py            # the grid below; results to benchmarks/results
    python benchmarks/verify_attention.py --sweep    # dev: time kernel configs at a few shapes

Grid: H = 64 (Kimi K2), B in {1, 8, 32, 64}, prefix in {512, 4096, 32768}, N in {16, 65}, page 64,
bf16. Rows see the whole prefix and a chain inside the tree (row n sees rows 0..n). Ours (the
default backend: the Gluon Hopper kernel on an H100 / H200) and the portable Triton kernel are
timed by CUDA-graph replay (median); SDPA (q as B x 1 x (N*H) rows against one shared KV head, boolean
mask [B, 1, N*H, L], K/V gathered contiguously beforehand and not timed) with CUDA events.
FLOPs = 2 * rows * keys * (576 + 512); bytes = KV read once per request + q + out; the floor is the
larger of FLOPs / measured bf16 matmul rate and bytes / measured copy bandwidth.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import environment, markdown_table, measure_ceilings, time_events_us, time_graph_us, write_results  # noqa: E402

from ddtree.attention import tree_verify_mla  # noqa: E402
from ddtree.tree import pack_visibility  # noqa: E402

HEADS, DIM, VDIM, PAGE = 64, 576, 512, 64
SCALE = 192**-0.5


def make_inputs(batch: int, prefix: int, rows: int, seed: int = 0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    pages = (prefix + rows + PAGE - 1) // PAGE
    kv = torch.randn(batch * pages, PAGE, DIM, device="cuda", generator=gen).bfloat16()
    block_table = torch.randperm(batch * pages, device="cuda", generator=gen).view(batch, pages).int()
    q = torch.randn(batch, rows, HEADS, DIM, device="cuda", generator=gen).bfloat16()
    chain = torch.ones(rows, rows, dtype=torch.bool, device="cuda").tril()
    vis = pack_visibility(chain.expand(batch, rows, rows))
    prefix_lens = torch.full((batch,), prefix, dtype=torch.int32, device="cuda")
    num_rows = torch.full((batch,), rows, dtype=torch.int32, device="cuda")
    return q, kv, block_table, prefix_lens, num_rows, vis, chain


def sdpa_baseline(q, kv, block_table, prefix, chain):
    """What a user has without the kernel: SDPA over the gathered cache with a dense bool mask."""
    batch, rows, heads, _ = q.shape
    length = prefix + rows
    slots = torch.arange(length, device="cuda")
    keys = kv[block_table[:, slots // PAGE].long(), slots % PAGE]  # [B, L, 576]
    k = keys[:, None]
    v = keys[:, None, :, :VDIM].contiguous()
    q_rows = q.reshape(batch, 1, rows * heads, DIM)
    mask = torch.ones(rows, length, dtype=torch.bool, device="cuda")
    mask[:, prefix:] = chain
    mask = mask.repeat_interleave(heads, 0)[None, None].expand(batch, 1, rows * heads, length)
    return lambda: torch.nn.functional.scaled_dot_product_attention(q_rows, k, v, attn_mask=mask, scale=SCALE)


def measure(batch, prefix, rows, ceilings, with_sdpa=True, **config) -> dict:
    q, kv, bt, pl, nn, vis, chain = make_inputs(batch, prefix, rows)
    def timed(**kw):
        return time_graph_us(lambda: tree_verify_mla(q, kv, bt, pl, nn, vis, SCALE, check=False, **kw),
                             launches_per_graph=5, trials=15)

    ours = timed(**config)
    triton_us = timed(backend="triton") if with_sdpa else None
    keys = prefix + rows
    flops = 2 * batch * rows * HEADS * keys * (DIM + VDIM)
    nbytes = 2 * (batch * keys * DIM + batch * rows * HEADS * (DIM + VDIM))
    compute_us = flops / (ceilings["bf16_matmul_TFLOPs"] * 1e6)
    memory_us = nbytes / (ceilings["copy_bandwidth_GBps"] * 1e3)
    row = {"B": batch, "prefix": prefix, "N": rows, "H": HEADS, "ours_us": ours,
           "ours_TFLOPs": flops / ours / 1e6, "ours_GBps": nbytes / ours / 1e3,
           "triton_us": triton_us, "triton_TFLOPs": flops / triton_us / 1e6 if triton_us else None,
           "floor_us": max(compute_us, memory_us), "bound": "compute" if compute_us >= memory_us else "memory"}
    row["ours_x_floor"] = ours / row["floor_us"]
    if with_sdpa:
        try:
            sdpa = time_events_us(sdpa_baseline(q, kv, bt, prefix, chain), trials=5, warmup=2)
            row.update(sdpa_us=sdpa, sdpa_TFLOPs=flops / sdpa / 1e6, speedup_vs_sdpa=sdpa / ours)
        except torch.OutOfMemoryError:
            row.update(sdpa_us=None, sdpa_TFLOPs=None, speedup_vs_sdpa=None)
        torch.cuda.empty_cache()
    print(row, flush=True)
    return row


def sweep(ceilings) -> None:
    print("| B | prefix | N | block_n | warps | stages | us | TFLOP/s |\n|---|---|---|---|---|---|---|---|")
    for batch, prefix, rows in [(32, 4096, 65), (1, 32768, 16), (64, 512, 16)]:
        for block_n in (32, 64):
            for warps in (4, 8):
                for stages in (1, 2, 3):
                    try:
                        r = measure(batch, prefix, rows, ceilings, with_sdpa=False, backend="triton",
                                    block_n=block_n, num_warps=warps, num_stages=stages)
                        print(f"| {batch} | {prefix} | {rows} | {block_n} | {warps} | {stages} | "
                              f"{r['ours_us']:.0f} | {r['ours_TFLOPs']:.0f} |", flush=True)
                    except Exception as e:  # out of shared memory / registers for this config
                        print(f"| {batch} | {prefix} | {rows} | {block_n} | {warps} | {stages} | failed: {type(e).__name__} | |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=None, help="results folder (default benchmarks/results)")
    parser.add_argument("--sweep", action="store_true", help="time kernel configs instead (prints only)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("verify_attention.py needs a CUDA GPU")
    ceilings = measure_ceilings()
    print(ceilings, flush=True)
    if args.sweep:
        return sweep(ceilings)
    results = [measure(b, p, n, ceilings) for b in (1, 8, 32, 64) for p in (512, 4096, 32768) for n in (16, 65)]

    def fmt(x, spec):
        return "OOM" if x is None else format(x, spec)

    table = markdown_table(
        ["B", "prefix", "N", "ours (us)", "TFLOP/s", "GB/s", "triton kernel (us)", "SDPA (us)", "SDPA TFLOP/s", "vs SDPA", "floor (us)", "bound", "x floor"],
        [[r["B"], r["prefix"], r["N"], f"{r['ours_us']:.1f}", f"{r['ours_TFLOPs']:.0f}", f"{r['ours_GBps']:.0f}",
          f"{r['triton_us']:.1f}", fmt(r["sdpa_us"], ".1f"), fmt(r["sdpa_TFLOPs"], ".0f"), fmt(r["speedup_vs_sdpa"], ".2f"),
          f"{r['floor_us']:.1f}", r["bound"], f"{r['ours_x_floor']:.2f}"] for r in results],
    )
    header = (f"H = {HEADS}, bf16, page {PAGE}. Measured ceilings: copy {ceilings['copy_bandwidth_GBps']:.0f} GB/s, "
              f"bf16 matmul {ceilings['bf16_matmul_TFLOPs']:.0f} TFLOP/s. 'bound' says which floor is larger.\n\n")
    payload = {"environment": environment(), "ceilings": ceilings, "results": results}
    print(header + table)
    print("wrote", write_results("verify_attention", payload, header + table, args.out))


if __name__ == "__main__":
    main()
