"""Where one INT4 routed-expert layer's time goes, kernel by kernel (torch.profiler's CUDA times):
the alignment, gate_up, down and the sum, for the group-interleaved experts at each --tokens and
tile. A diagnostic beside benchmarks/moe_paths.py (which times the whole layer by graph replay).

    python dev/int4_kernel_split.py --tokens 1 9 65 2080 --tiles 16x64x64 64x64x64s2 64x128x64w8s2
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from moe_paths import launch_settings, moe_layer, parse_tile  # noqa: E402

from ddtree.ops.int4 import interleave_int4  # noqa: E402
from ddtree.ops.moe import Workspace, fused_moe  # noqa: E402
from ddtree.ops.moe_align import token_chunks  # noqa: E402


@torch.no_grad()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="kimi-k2.6")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 9, 65, 2080])
    parser.add_argument("--tiles", nargs="+", default=["16x64x64", "64x64x64s2"])
    parser.add_argument("--runs", type=int, default=20)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("int4_kernel_split.py times CUDA kernels: no GPU here")
    # every tile interleaved: ":gi" unless it names ":gi128" (128-column K steps); auto is refused by parse_tile
    tiles = [parse_tile(text if text.endswith((":gi", ":gi128")) else text + ":gi") for text in args.tiles]
    layer = moe_layer(args.config)
    if layer.int4 is None:
        raise SystemExit(f"--config {args.config}: its routed experts are not INT4")
    experts = tuple(interleave_int4(w) for w in layer.experts())
    cfg = layer.gate.cfg
    shape = (cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size)
    print(f"# {torch.cuda.get_device_name()}; {args.config}, interleaved INT4 experts; us per layer, mean of "
          f"{args.runs} runs")
    for t in args.tokens:
        x = torch.randn(t, cfg.hidden_size, device="cuda", dtype=torch.bfloat16)
        weights, ids = layer.gate(x)
        parts = token_chunks(t, ids.shape[1])  # past MAX_PAIRS, in the chunks the MoE layer itself runs
        out = torch.empty_like(x)
        for text, (m, n, k, warps, stages, unpack) in zip(args.tiles, tiles):
            spaces = [Workspace.empty(p.stop - p.start, ids.shape[1], *shape, x.dtype, x.device, m) for p in parts]
            with launch_settings(warps, stages, unpack):
                def run():  # preallocated: only the layer's own kernels are counted
                    for p, ws in zip(parts, spaces):
                        fused_moe(x[p], *experts, weights[p], ids[p], out=out[p], workspace=ws, block_m=m,
                                  block_n=n, block_k=k)
                for _ in range(3):
                    run()
                torch.cuda.synchronize()
                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    for _ in range(args.runs):
                        run()
                    torch.cuda.synchronize()
            totals = defaultdict(float)
            for event in prof.events():
                if event.device_type == torch.autograd.DeviceType.CUDA:
                    totals[event.name.split("(")[0][:40]] += event.device_time / args.runs
            summary = ", ".join(f"{name} {us:.1f}" for name, us in sorted(totals.items(), key=lambda kv: -kv[1]))
            print(f"tokens {t:5d} tile {text:14s} total {sum(totals.values()):9.1f}: {summary}", flush=True)


if __name__ == "__main__":
    main()
