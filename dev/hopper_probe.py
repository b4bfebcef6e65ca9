"""Hopper vs Triton backend of tree_verify_mla: agreement and speed at the bar shapes."""

import sys
from pathlib import Path


sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from common import time_graph_us  # noqa: E402
from verify_attention import SCALE, make_inputs  # noqa: E402

from ddtree.attention import tree_verify_mla  # noqa: E402

for batch, prefix, rows in [(32, 4096, 65), (1, 32768, 16), (8, 512, 16), (64, 512, 16), (64, 32768, 65)]:
    q, kv, bt, pl, nn, vis, _ = make_inputs(batch, prefix, rows)
    res = {}
    for backend in ("hopper", "triton"):
        out, lse = tree_verify_mla(q, kv, bt, pl, nn, vis, SCALE, backend=backend)
        us = time_graph_us(lambda: tree_verify_mla(q, kv, bt, pl, nn, vis, SCALE, check=False, backend=backend),
                           launches_per_graph=5, trials=10)
        res[backend] = (out.float(), us)
    flops = 2 * batch * rows * 64 * (prefix + rows) * 1088
    diff = (res["hopper"][0] - res["triton"][0]).norm() / res["triton"][0].norm()
    print(f"B{batch} P{prefix} N{rows}: hopper {res['hopper'][1]:.0f} us {flops / res['hopper'][1] / 1e6:.0f} TFLOP/s | "
          f"triton {res['triton'][1]:.0f} us {flops / res['triton'][1] / 1e6:.0f} TFLOP/s | rel diff {diff:.1e}", flush=True)
