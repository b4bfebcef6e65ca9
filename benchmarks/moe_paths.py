"""Routed experts: the fused Triton MoE (ops/moe.py, several tile shapes) against the grouped-GEMM
path (ops/moe_grouped.grouped_moe, torch._grouped_mm) it replaces below KernelPolicy.moe_fused_max_tokens,
and against the floors.

    python benchmarks/moe_paths.py --configs moonlight-16b-a3b kimi-k2 --tokens 1 2 4 8 16 32 64 65 128
    python benchmarks/moe_paths.py --configs kimi-k2.6 --tokens 1 9 65 2080 --tiles auto   # INT4 experts
    python benchmarks/moe_paths.py --configs kimi-k2.6 --tokens 1 9 65 --tiles auto,16x32x128,2x32x256
        # INT4 tiles: BLOCK_M below 16 is the row kernels' (ops/moe_int4_rows.py)
    python benchmarks/moe_paths.py --configs kimi-k2.6 --tokens 2080 --tiles auto,64x128x64w8,64x128x64w8s2
        # a tile's w / s suffix: the launches' warps and pipeline stages (ops/moe.py's NUM_WARPS and
        # NUM_STAGES, moe_int4.INT4_ROWS_WARPS for the row kernels, set for that tile's runs only); :word
        # or :pairs: how its INT4 tiles unpack (INT4_UNPACK, ops/int4_tiles.py); :pairs-ws: in pairs with
        # the scales loaded one per word (INT4_SCALE_PAIRS off); :gi: the experts in the group-interleaved
        # order (ops/int4.interleave_int4, ops/int4_interleaved.py; those tiles step K by 256 themselves,
        # K sizes only the shared experts' tiles in the same launch); :gi128: the same at 128-column K
        # steps (moe_int4.INT4_INTERLEAVED_STEP)

One MoE layer of each config with random weights on the GPU (bf16, or INT4 packed as the checkpoint
stores them where the config says so); the router's own choices on random rows (so routing is
about uniform, as in a balanced trained model). Each time is the median of CUDA-graph replays
(common.time_graph_us), the router excluded: both paths get the same ids. auto takes the INT4 experts
in the group-interleaved order where the models do (sm_90, group 32). The grouped path is
timed for 16-bit experts only (INT4's is a reference that dequantizes every chosen expert).
floor = distinct experts touched x bytes per expert (as stored) / copy bandwidth; compute floor =
2 x tokens x k x 3 x hidden x inter FLOPs / bf16 matmul rate; both measured in this run.
Writes moe_paths-<gpu>.{json,md}.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import environment, markdown_table, measure_ceilings, time_graph_us, write_results  # noqa: E402

from ddtree.models import TargetConfig  # noqa: E402
from ddtree.models.checkpoint import init_random  # noqa: E402
from ddtree.models.layers import MoE  # noqa: E402
from ddtree.ops import KernelPolicy  # noqa: E402
from ddtree.ops import moe, moe_int4  # noqa: E402
from ddtree.ops.int4 import interleave_int4  # noqa: E402
from ddtree.ops.moe import Workspace, fused_moe  # noqa: E402
from ddtree.ops.moe_grouped import grouped_moe  # noqa: E402
from ddtree.ops.moe_align import token_chunks  # noqa: E402

CONFIGS = Path(__file__).resolve().parent / "configs"
TILES = "auto,16x64x128,16x32x128,16x128x64,16x64x64,32x64x128,64x64x64"  # BLOCK_M x BLOCK_N x BLOCK_K


TILE = re.compile(r"(\d+)x(\d+)x(\d+)(?:w(\d+))?(?:s(\d+))?(?::(word|pairs-ws|pairs|gi128|gi))?")


def parse_tile(text: str):
    """None for "auto", else (M, N, K, warps or None, stages or None, INT4 unpacking or None) from
    "MxNxK[wW][sS][:word|:pairs|:pairs-ws|:gi|:gi128]" (ops/moe_int4.py's INT4_UNPACK and INT4_SCALE_PAIRS,
    ops/int4_tiles.py; gi: interleaved experts, gi128: those at 128-column K steps)."""
    if text == "auto":
        return None
    match = TILE.fullmatch(text)
    if match is None:
        raise SystemExit(f"--tiles: {text!r} is not auto or MxNxK[wW][sS][:word|:pairs|:pairs-ws|:gi|:gi128] "
                         "(e.g. 64x128x64w8s2:pairs)")
    *numbers, unpack = match.groups()
    return (*(int(v) if v else None for v in numbers), unpack)


def tile_name(tile) -> str:
    if tile is None:
        return "auto"
    m, n, k, warps, stages, unpack = tile
    suffix = (f"w{warps}" if warps else "") + (f"s{stages}" if stages else "") + (f":{unpack}" if unpack else "")
    return f"{m}x{n}x{k}{suffix}"


@contextlib.contextmanager
def launch_settings(warps: int | None, stages: int | None, unpack: str | None = None):
    """ops/moe.py's and moe_int4.py's launch constants set to these (None: as they are) while the
    block runs."""
    saved = (moe.NUM_WARPS, moe_int4.INT4_ROWS_WARPS, moe.NUM_STAGES, moe_int4.INT4_UNPACK, moe_int4.INT4_SCALE_PAIRS,
             moe_int4.INT4_INTERLEAVED_STAGES_MANY, moe_int4.INT4_INTERLEAVED_STEP)
    moe.NUM_WARPS = warps or saved[0]
    moe_int4.INT4_ROWS_WARPS = warps or saved[1]
    moe.NUM_STAGES = stages or saved[2]
    moe_int4.INT4_INTERLEAVED_STAGES_MANY = stages or saved[5]
    moe_int4.INT4_UNPACK = unpack.removesuffix("-ws") if unpack in ("word", "pairs", "pairs-ws") else saved[3]
    moe_int4.INT4_SCALE_PAIRS = saved[4] if unpack in (None, "gi", "gi128") else not unpack.endswith("-ws")
    moe_int4.INT4_INTERLEAVED_STEP = 128 if unpack == "gi128" else 256 if unpack == "gi" else saved[6]
    try:
        yield
    finally:
        (moe.NUM_WARPS, moe_int4.INT4_ROWS_WARPS, moe.NUM_STAGES, moe_int4.INT4_UNPACK,
         moe_int4.INT4_SCALE_PAIRS, moe_int4.INT4_INTERLEAVED_STAGES_MANY, moe_int4.INT4_INTERLEAVED_STEP) = saved


def moe_layer(name: str) -> MoE:
    cfg = TargetConfig.from_dict(json.loads((CONFIGS / f"{name}.json").read_text()))
    with torch.device("meta"):
        layer = MoE(cfg)
    layer.shared_experts = None  # dense and the same on both paths: not what is compared
    layer = layer.to(torch.bfloat16).to_empty(device="cuda")
    return init_random(layer, seed=0)  # INT4: random words and scales, as random_target makes them


@torch.no_grad()
def time_layer(name: str, layer: MoE, tokens: list[int], ceilings: dict, tiles) -> list[dict]:
    cfg = layer.gate.cfg
    e, h, i = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size
    stored = list(layer.parameters(recurse=False))
    expert_bytes = sum(p.numel() * p.element_size() for p in stored) / e
    experts = layer.experts()
    int4 = layer.int4 is not None
    # auto: fused_moe's choice on the experts as the models store them, in the interleaved order
    # where it runs natively (models/int4_order.py), as the engine runs them
    native_gi = int4 and moe_int4.interleavable(*experts, experts[0].packed.device)
    gi = native_gi or any(tile and tile[5] in ("gi", "gi128") for tile in tiles)
    interleaved = tuple(interleave_int4(w) for w in experts) if int4 and gi else None
    rows = []
    for t in tokens:
        x = torch.randn(t, h, device="cuda", dtype=torch.bfloat16)
        weights, ids = layer.gate(x)
        touched = int(ids.unique().numel())
        floor = touched * expert_bytes / (ceilings["copy_bandwidth_GBps"] * 1e3)
        compute = 2 * t * ids.shape[1] * 3 * h * i / (ceilings["bf16_matmul_TFLOPs"] * 1e6)
        row = {"config": name, "int4": int4, "tokens": t, "experts_touched": touched, "floor_us": floor,
               "compute_floor_us": compute}
        if not int4:
            row["grouped_us"] = time_graph_us(lambda: grouped_moe(x, *experts, weights, ids), launches_per_graph=5,
                                              trials=15)
        out = torch.empty_like(x)
        # INT4's reference dequantizes every expert its rows chose: at thousands of rows, all of
        # them in float32, more than a GPU holds; a few rows' worth checks the kernel's output there
        check = min(t, 4) if int4 else t
        want = grouped_moe(x[:check], *experts, weights[:check], ids[:check]).float()
        for tile in tiles:
            # auto: fused_moe's own choice (block_m_for, tiles_for)
            m, n, k, warps, stages, unpack = tile or (None,) * 6
            parts = token_chunks(t, ids.shape[1])  # past MAX_PAIRS, in the chunks the MoE layer itself runs
            weights_of_tile = interleaved if unpack in ("gi", "gi128") or (tile is None and native_gi) else experts
            if weights_of_tile is None:
                raise SystemExit(f"--tiles {tile_name(tile)}: :gi / :gi128 take INT4 experts only")
            with launch_settings(warps, stages, unpack):
                row_kernels = int4 and moe_int4.int4_row_kernels(x, *weights_of_tile)  # as fused_moe decides here
                spaces = [Workspace.empty(p.stop - p.start, ids.shape[1], e, h, i, x.dtype, x.device, m,
                                          row_kernels=row_kernels) for p in parts]

                def run(m=m, n=n, k=k, parts=parts, spaces=spaces, w=weights_of_tile):
                    for p, ws in zip(parts, spaces):
                        fused_moe(x[p], *w, weights[p], ids[p], out=out[p], workspace=ws, block_m=m,
                                  block_n=n, block_k=k)

                out.fill_(float("nan"))
                run()
                err = (out[:check].float() - want).abs().max().item() / max(want.abs().max().item(), 1e-6)
                row[f"fused_{tile_name(tile)}_us"] = time_graph_us(run, launches_per_graph=5, trials=15)
            row[f"fused_{tile_name(tile)}_rel_err"] = err
        fused = {key: v for key, v in row.items() if key.startswith("fused_") and key.endswith("_us")}
        best = min(fused, key=fused.get)
        row |= {"best_fused": best.removeprefix("fused_").removesuffix("_us"), "best_fused_us": fused[best],
                "grouped_over_best_fused": row["grouped_us"] / fused[best] if "grouped_us" in row else None,
                "best_fused_over_floor": fused[best] / max(floor, compute)}
        print({k: (round(v, 1) if isinstance(v, float) else v) for k, v in row.items() if not k.endswith("_err")}, flush=True)
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", nargs="+", default=["moonlight-16b-a3b", "kimi-k2"])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 65, 128])
    parser.add_argument("--tiles", default=TILES, help="comma-separated MxNxK tiles, or auto (fused_moe's choice)")
    parser.add_argument("--out", type=Path, default=None, help="results folder (default benchmarks/results)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("moe_paths.py needs a CUDA GPU")
    ceilings = measure_ceilings()
    print("ceilings", ceilings, flush=True)
    tiles = [parse_tile(t) for t in args.tiles.split(",")]
    rows = []
    for name in args.configs:
        layer = moe_layer(name)
        for tokens in args.tokens:  # written after every count: a run cut short keeps what it measured
            rows += time_layer(name, layer, [tokens], ceilings, tiles)
            path = write_results("moe_paths", {"environment": environment(), "ceilings": ceilings,
                                               "tiles": [tile_name(t) for t in tiles], "rows": rows},
                                 report(rows, tiles, ceilings), args.out)
        del layer
        torch.cuda.empty_cache()
    print(path.read_text())


def report(rows: list[dict], tiles, ceilings: dict) -> str:
    tile_names = [tile_name(t) for t in tiles]
    fmt = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
    table = markdown_table(
        ["config", "experts", "tokens", "experts touched", "read floor (us)", "compute floor (us)", "grouped (us)",
         *[f"fused {t} (us)" for t in tile_names], "grouped / best fused", "best fused / floor"],
        [[r["config"], "INT4" if r.get("int4") else "bf16", r["tokens"], r["experts_touched"], f"{r['floor_us']:.1f}",
          f"{r['compute_floor_us']:.1f}", fmt(r.get("grouped_us"), ".1f"),
          *[f"{r[f'fused_{t}_us']:.1f}" for t in tile_names], fmt(r["grouped_over_best_fused"], ".2f"),
          f"{r['best_fused_over_floor']:.2f}"] for r in rows])
    return (f"One routed-expert layer (shared expert left out, router excluded), random weights; tiles are "
            f"BLOCK_M x BLOCK_N x BLOCK_K, auto is fused_moe's own choice (block_m_for, tiles_for; INT4 experts in "
            f"the interleaved order where the models take it). MoE takes the "
            f"fused path automatically at <= {KernelPolicy().moe_fused_max_tokens} tokens. Measured ceilings: copy "
            f"{ceilings['copy_bandwidth_GBps']:.0f} GB/s, bf16 matmul {ceilings['bf16_matmul_TFLOPs']:.0f} TFLOP/s.\n\n"
            + table)


if __name__ == "__main__":
    main()
