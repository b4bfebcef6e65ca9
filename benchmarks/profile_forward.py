"""Kernel-level profile of one target forward (torch.profiler, CUDA), to see where a decode
step or a tree verify spends its time: kernels per forward, and time per kernel name.

    python benchmarks/profile_forward.py --config moonlight-16b-a3b --shapes 1x1,1x65 --kernels auto reference

--kernels profiles the same forward once per kernel policy (ops/policy.py): "auto"
(the Triton norm, MLA, router and few-row MoE kernels on CUDA) and "reference" (PyTorch paths).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import environment, markdown_table, write_results  # noqa: E402
from target_forward import CONFIGS, setup  # noqa: E402

from ddtree.models import TargetConfig, random_target  # noqa: E402
from ddtree.ops import PATHS, KernelPolicy, apply_policy  # noqa: E402


@torch.no_grad()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="moonlight-16b-a3b")
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--prefix", type=int, default=1024)
    parser.add_argument("--shapes", default="1x1,1x65,8x65", help="BxN pairs: batch x rows per request")
    parser.add_argument("--forwards", type=int, default=5)
    parser.add_argument("--kernels", nargs="+", default=["auto"], choices=PATHS)
    parser.add_argument("--out", type=Path, default=None, help="results folder (default benchmarks/results)")
    args = parser.parse_args()
    raw = json.loads((CONFIGS / f"{args.config}.json").read_text())
    if args.layers:
        raw["num_hidden_layers"] = args.layers
    cfg = TargetConfig.from_dict(raw)
    model = random_target(cfg, dtype=torch.bfloat16, device="cuda")
    summary = {}
    for choice, shape in [(c, s) for c in args.kernels for s in args.shapes.split(",")]:
        apply_policy(model, KernelPolicy(choice))
        batch, rows = map(int, shape.split("x"))
        ids, meta, caches = setup(model, batch, rows, args.prefix)
        for _ in range(3):
            model.forward_paged(ids, meta, caches)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(args.forwards):
                model.forward_paged(ids, meta, caches)
            torch.cuda.synchronize()
        events = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
        kernels = sum(e.count for e in events) / args.forwards
        total_us = sum(e.device_time_total for e in events) / args.forwards
        rows_out = sorted(((e.key, e.count / args.forwards, e.device_time_total / args.forwards) for e in events),
                          key=lambda r: -r[2])
        summary[f"{shape} {choice}"] = {"kernels": choice, "kernels_per_forward": kernels, "kernel_us_per_forward": total_us,
                          "by_name": [{"name": n[:120], "per_forward": c, "us_per_forward": t} for n, c, t in rows_out[:40]]}
        print(f"{shape} {choice}: {kernels:.0f} kernels, {total_us / 1e3:.2f} ms of kernel time per forward", flush=True)
        for n, c, t in rows_out[:25]:
            print(f"  {t / 1e3:8.3f} ms  {c:6.0f}x  {n[:100]}", flush=True)
    payload = {"environment": environment(), "config": args.config, "layers": cfg.num_hidden_layers,
               "prefix": args.prefix, "forwards": args.forwards, "shapes": summary}
    write_results(f"profile_forward-{args.config}", payload, tables(summary), args.out)


def tables(summary: dict) -> str:
    """Per shape: kernels and kernel time per forward, then the 15 costliest kernel names."""
    parts = []
    for shape, s in summary.items():
        rows = [[f"{r['us_per_forward'] / 1e3:.3f}", f"{r['per_forward']:.0f}", r["name"][:90]] for r in s["by_name"][:15]]
        parts.append(f"### {shape} (batch x rows, kernel paths): {s['kernels_per_forward']:.0f} kernels, "
                     f"{s['kernel_us_per_forward'] / 1e3:.2f} ms of kernel time per forward\n\n"
                     + markdown_table(["ms per forward", "launches", "kernel"], rows))
    return "\n\n".join(parts)


if __name__ == "__main__":
    main()
