"""Which way of unpacking INT4 words runs a one-row GEMV at the weights' read rate: variants of one
kernel, y = W x for W packed as compressed-tensors packs it ([N, K / 8] int32, a bf16 scale per 32
columns), on the shape of a Kimi K2.6 decode token's gate/up projections (8 experts x 4096 rows,
K = 7168), each checked against the float32 dequantized product and timed by CUDA-graph replay.

    read      the words and scales only (no unpacking): the access pattern's bandwidth
    split     the activations split by column within a word (tl.split), 8 products per word
    permuted  the activations pre-permuted to [8, K / 8]: 8 direct loads of one column each
    cube      values as [N, WORDS, 8] by broadcast shifts, activations as [WORDS, 8], summed over the 8
    convert   cube with an int-to-float conversion instead of the mantissa trick

    python dev/int4_gemv_variants.py [--rows 32768] [--depth 7168]
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from ddtree.ops.int4 import dequantize_int4, quantize_int4  # noqa: E402

VARIANTS = {"read": 0, "split": 1, "permuted": 2, "cube": 3, "convert": 4}


@triton.jit
def _nibble(words, i: tl.constexpr):
    bits = ((words >> (4 * i)) & 0xF) | 0x4B000000
    return bits.to(tl.float32, bitcast=True) - 8388616.0


@triton.jit
def gemv_kernel(x_ptr, xp_ptr, packed_ptr, scale_ptr, y_ptr, K, GROUP: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, VARIANT: tl.constexpr):
    WORDS: tl.constexpr = BLOCK_K // 8
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = offs_n.to(tl.int64)[:, None]
    kw = K // 8
    acc = tl.zeros([BLOCK_N, WORDS], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        word = k0 // 8 + tl.arange(0, WORDS)
        words = tl.load(packed_ptr + rows * kw + word[None, :])
        scale = tl.load(scale_ptr + rows * (K // GROUP) + (word * 8 // GROUP)[None, :]).to(tl.float32)
        if VARIANT == 0:
            acc += tl.where(words > 0, scale, 0.0)  # touches every word and scale, no result
        elif VARIANT == 1:
            a = tl.reshape(tl.load(x_ptr + k0 + tl.arange(0, BLOCK_K)).to(tl.float32), (WORDS, 2, 2, 2))
            c0, c1 = tl.split(a)
            c0b0, c0b1 = tl.split(c0)
            c1b0, c1b1 = tl.split(c1)
            x0, x4 = tl.split(c0b0)
            x2, x6 = tl.split(c0b1)
            x1, x5 = tl.split(c1b0)
            x3, x7 = tl.split(c1b1)
            t = _nibble(words, 0) * x0[None, :] + _nibble(words, 1) * x1[None, :]
            t += _nibble(words, 2) * x2[None, :] + _nibble(words, 3) * x3[None, :]
            t += _nibble(words, 4) * x4[None, :] + _nibble(words, 5) * x5[None, :]
            t += _nibble(words, 6) * x6[None, :] + _nibble(words, 7) * x7[None, :]
            acc += t * scale
        elif VARIANT == 2:
            t = _nibble(words, 0) * tl.load(xp_ptr + word)[None, :].to(tl.float32)
            t += _nibble(words, 1) * tl.load(xp_ptr + kw + word)[None, :].to(tl.float32)
            t += _nibble(words, 2) * tl.load(xp_ptr + 2 * kw + word)[None, :].to(tl.float32)
            t += _nibble(words, 3) * tl.load(xp_ptr + 3 * kw + word)[None, :].to(tl.float32)
            t += _nibble(words, 4) * tl.load(xp_ptr + 4 * kw + word)[None, :].to(tl.float32)
            t += _nibble(words, 5) * tl.load(xp_ptr + 5 * kw + word)[None, :].to(tl.float32)
            t += _nibble(words, 6) * tl.load(xp_ptr + 6 * kw + word)[None, :].to(tl.float32)
            t += _nibble(words, 7) * tl.load(xp_ptr + 7 * kw + word)[None, :].to(tl.float32)
            acc += t * scale
        else:
            shifts = (tl.arange(0, 8) * 4)[None, None, :]
            if VARIANT == 3:
                bits = ((words[:, :, None] >> shifts) & 0xF) | 0x4B000000
                q = bits.to(tl.float32, bitcast=True) - 8388616.0
            else:
                q = (((words[:, :, None] >> shifts) & 0xF) - 8).to(tl.float32)
            x = tl.load(x_ptr + word[:, None] * 8 + tl.arange(0, 8)[None, :]).to(tl.float32)
            acc += tl.sum(q * x[None, :, :], 2) * scale
    tl.store(y_ptr + offs_n, tl.sum(acc, 1))


def markdown(report: dict) -> str:
    """The results as a markdown table (environment first), sorted by variant, then time."""
    lines = ["# int4_gemv_variants", ""] + [f"- {k}: {v}" for k, v in report["environment"].items()]
    lines += ["", f"One-row INT4 GEMV y = W x, W {report['rows']} x {report['depth']} packed as compressed-tensors "
              f"packs it, {report['bytes'] / 1e6:.1f} MB stored; read floor {report['floor_us']:.1f} us at the measured "
              f"copy bandwidth {report['ceilings']['copy_bandwidth_GBps']:.0f} GB/s. Times: median of CUDA-graph "
              "replays. `read` computes no product (its rel err is meaningless).", "",
              "| variant | BLOCK_N | BLOCK_K | warps | us | / floor | rel err |", "|---|---|---|---|---|---|---|"]
    for r in sorted(report["results"], key=lambda r: (r["variant"], r["us"])):
        lines.append(f"| {r['variant']} | {r['block_n']} | {r['block_k']} | {r['warps']} | {r['us']:.1f} | "
                     f"{r['over_floor']:.2f} | {r['rel_err']:.1e} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=8 * 4096)
    parser.add_argument("--depth", type=int, default=7168)
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS))
    parser.add_argument("--block-n", type=int, nargs="+", default=[8, 16, 32])
    parser.add_argument("--block-k", type=int, nargs="+", default=[128, 256])
    parser.add_argument("--warps", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--markdown-from", type=Path, default=None, help="a results JSON: write its .md beside it")
    args = parser.parse_args()
    if args.markdown_from:
        args.markdown_from.with_suffix(".md").write_text(markdown(json.loads(args.markdown_from.read_text())))
        return
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator().manual_seed(0)
    w = quantize_int4(torch.randn(1, args.rows, args.depth, generator=gen), 32)
    packed, scale = w.packed[0].to(device), w.scale[0].to(device)
    x = torch.randn(args.depth, generator=gen).to(torch.bfloat16).to(device)
    xp = x.view(-1, 8).t().contiguous()  # [8, K / 8]: column i of every word, for "permuted"
    want = dequantize_int4(w, torch.float32)[0].to(device) @ x.float()
    stored = packed.numel() * 4 + scale.numel() * 2
    report = {"rows": args.rows, "depth": args.depth, "bytes": stored, "results": []}
    if device == "cuda":
        from common import environment, measure_ceilings, time_graph_us
        report["environment"], report["ceilings"] = environment(), measure_ceilings()
        floor = stored / (report["ceilings"]["copy_bandwidth_GBps"] * 1e3)
        report["floor_us"] = floor
        print(f"floor {floor:.1f} us ({stored / 1e6:.1f} MB)", flush=True)
    for name, bn, bk, warps in itertools.product(args.variants, args.block_n, args.block_k, args.warps):
        y = torch.full((args.rows,), float("nan"), device=device)

        def run(y=y, bn=bn, bk=bk, warps=warps, variant=VARIANTS[name]):
            gemv_kernel[(triton.cdiv(args.rows, bn),)](x, xp, packed, scale, y, args.depth, GROUP=32, BLOCK_N=bn,
                                                        BLOCK_K=bk, VARIANT=variant, num_warps=warps)
        try:
            run()
        except Exception as error:  # a variant that does not compile is a result too
            print(name, bn, bk, warps, "failed:", str(error).splitlines()[-1][:200], flush=True)
            continue
        err = float((y - want).norm() / want.norm())
        row = {"variant": name, "block_n": bn, "block_k": bk, "warps": warps, "rel_err": err}
        if device == "cuda":
            row["us"] = time_graph_us(run, launches_per_graph=10, trials=15)
            row["over_floor"] = row["us"] / report["floor_us"]
        print(row, flush=True)
        report["results"].append(row)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "int4_gemv_variants.json").write_text(json.dumps(report, indent=1))
        if device == "cuda":
            (args.out / "int4_gemv_variants.md").write_text(markdown(report))


if __name__ == "__main__":
    main()
