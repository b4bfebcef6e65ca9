"""Hopper kernel time against num_splits at the shapes with few row tiles (prints a table)."""

import sys
from pathlib import Path


sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from common import time_graph_us  # noqa: E402
from verify_attention import SCALE, make_inputs  # noqa: E402

from ddtree.attention import choose_num_splits, tree_verify_mla  # noqa: E402

SPLITS = tuple(int(a) for a in sys.argv[1].split(",")) if len(sys.argv) > 1 else (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)
print("| B | prefix | N | auto | " + " | ".join(f"s={s}" for s in SPLITS) + " |")
for batch, prefix, rows in [(1, 512, 16), (1, 512, 65), (1, 4096, 16), (1, 4096, 65), (1, 32768, 16),
                            (1, 32768, 65), (8, 512, 16), (8, 4096, 16), (8, 32768, 16), (8, 512, 65),
                            (8, 4096, 65), (32, 512, 16), (32, 4096, 16), (64, 512, 16), (32, 512, 65)]:
    q, kv, bt, pl, nn, vis, _ = make_inputs(batch, prefix, rows)
    auto = choose_num_splits(batch, rows * 64, bt.shape[1] * 64, q.device, "hopper")
    cells = []
    for s in SPLITS:
        us = time_graph_us(lambda: tree_verify_mla(q, kv, bt, pl, nn, vis, SCALE, check=False, num_splits=s),
                           launches_per_graph=3, trials=7)
        cells.append(f"{us:.1f}")
    print(f"| {batch} | {prefix} | {rows} | {auto} | " + " | ".join(cells) + " |", flush=True)
