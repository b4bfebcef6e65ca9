"""Hopper kernel epilogues (0: direct stores from the MMA layout, 1: staged in shared memory +
16-byte stores, 2: staged + TMA store), alternated and repeated to see run-to-run spread."""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from common import time_graph_us  # noqa: E402
from verify_attention import SCALE, make_inputs  # noqa: E402

from ddtree.attention import api  # noqa: E402

for batch, prefix, rows in [(64, 512, 16), (32, 512, 16), (64, 512, 65), (8, 512, 16), (1, 512, 65), (64, 4096, 16), (8, 32768, 16)]:
    q, kv, bt, pl, nn, vis, _ = make_inputs(batch, prefix, rows)
    out = torch.empty(batch, rows, 64, 512, dtype=q.dtype, device="cuda")
    lse = torch.empty(batch, rows, 64, device="cuda")
    res = {0: [], 1: [], 2: []}
    for _ in range(3):
        for ep in (0, 1, 2):
            res[ep].append(time_graph_us(
                lambda: api._launch_hopper(q, kv, bt, pl, nn, vis, out.unsqueeze(3), lse.unsqueeze(3), SCALE, 1, epilogue=ep),
                launches_per_graph=5, trials=10))
    print(f"B{batch} P{prefix} N{rows}: " + " | ".join(f"epilogue {k}: " + ", ".join(f"{v:.1f}" for v in vs)
                                                    for k, vs in res.items()), flush=True)
