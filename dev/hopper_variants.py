"""Where the Hopper kernel's per-program time goes: variants switched by constexpr flags, timed
at a one-tile shape, a 9-tile shape and the bar shape; outputs checked against the default."""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from common import time_graph_us  # noqa: E402
from verify_attention import SCALE, make_inputs  # noqa: E402

from ddtree.attention import api  # noqa: E402

VARIANTS = {
    "default": dict(),
    "direct epilogue": dict(SMEM_EPILOGUE=False),
    "no output store": dict(PROBE=1),
    "no Q load": dict(PROBE=2),
    "no bitmask": dict(PROBE=3),
    "no zero fix-up": dict(PROBE=4),
}
for batch, prefix, rows in [(64, 0, 16), (64, 512, 16), (32, 512, 65), (32, 4096, 65)]:
    q, kv, bt, pl, nn, vis, _ = make_inputs(batch, prefix, rows)
    out = torch.empty(batch, rows, 64, 512, dtype=q.dtype, device="cuda")
    lse = torch.empty(batch, rows, 64, device="cuda")
    def run(**flags):
        api._launch_hopper(q, kv, bt, pl, nn, vis, out.unsqueeze(3), lse.unsqueeze(3), SCALE, 1, **flags)
    run()
    want = out.clone()
    line = []
    for name, flags in VARIANTS.items():
        out.fill_(float("nan"))
        run(**flags)
        same = torch.equal(out, want) if "PROBE" not in flags else "-"
        us = time_graph_us(lambda: run(**flags), launches_per_graph=5, trials=10)
        line.append(f"{name}: {us:.1f} us (same {same})")
    print(f"B{batch} P{prefix} N{rows}: " + " | ".join(line), flush=True)
