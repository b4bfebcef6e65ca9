"""Per-program fixed cost of the Hopper kernel: time vs prefix length at fixed B, N (one KV tile
more per 64 keys), fitted to a line; the intercept is the per-program overhead."""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from common import time_graph_us  # noqa: E402
from verify_attention import SCALE, make_inputs  # noqa: E402

from ddtree.attention import tree_verify_mla  # noqa: E402

sms = torch.cuda.get_device_properties(0).multi_processor_count
for batch, rows in [(64, 16), (8, 65)]:
    pts = []
    for prefix in (0, 448, 960, 1984, 4032):
        q, kv, bt, pl, nn, vis, _ = make_inputs(batch, prefix, rows)
        us = time_graph_us(lambda: tree_verify_mla(q, kv, bt, pl, nn, vis, SCALE, check=False, num_splits=1),
                           launches_per_graph=5, trials=10)
        programs = batch * ((rows * 64 + 63) // 64)
        waves = -(-programs // sms)
        tiles = -(-(prefix + rows) // 64)
        pts.append((tiles, us / waves))
        print(f"B{batch} N{rows} prefix {prefix}: {us:.1f} us, {waves} waves, {tiles} tiles, {us / waves:.2f} us per wave", flush=True)
    t = torch.tensor(pts, dtype=torch.float64)
    A = torch.stack([t[:, 0], torch.ones(len(pts), dtype=torch.float64)], 1)
    slope, icpt = torch.linalg.lstsq(A, t[:, 1:]).solution.flatten().tolist()
    print(f"  fit: {slope:.2f} us per KV tile, {icpt:.2f} us per program", flush=True)
