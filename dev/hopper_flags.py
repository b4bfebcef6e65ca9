"""Hopper kernel constexpr variants (LAZY: rescale only when a row maximum grows by > 8; L2D:
row sums reduced once per item), checked against the default and timed, plus a clock probe:
the same shape timed before and right after a few seconds of sustained load."""

import itertools
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from common import time_graph_us  # noqa: E402
from verify_attention import SCALE, make_inputs  # noqa: E402

from ddtree.attention import api  # noqa: E402


def clocks() -> str:
    q = "clocks.sm,clocks.max.sm,temperature.gpu,power.draw,clocks_event_reasons.active"
    return subprocess.run(["nvidia-smi", f"--query-gpu={q}", "--format=csv,noheader"], capture_output=True,
                          text=True).stdout.strip()


def launcher(batch, prefix, rows, **flags):
    q, kv, bt, pl, nn, vis, _ = make_inputs(batch, prefix, rows)
    out = torch.empty(batch, rows, 64, 512, dtype=q.dtype, device="cuda")
    lse = torch.empty(batch, rows, 64, device="cuda")
    splits = api.choose_num_splits(batch, rows * 64, bt.shape[1] * 64, q.device, "hopper")
    part = torch.empty(batch, rows, 64, splits, 512, device="cuda") if splits > 1 else out.unsqueeze(3)
    part_lse = torch.empty(batch, rows, 64, splits, device="cuda") if splits > 1 else lse.unsqueeze(3)
    return (lambda: api._launch_hopper(q, kv, bt, pl, nn, vis, part, part_lse, SCALE, splits, **flags)), part, part_lse


combos = [dict(LAZY=a, L2D=b) for a, b in itertools.product((False, True), repeat=2)]
for shape in [(64, 512, 16), (32, 512, 16), (8, 512, 65), (32, 4096, 65), (1, 32768, 16)]:
    ref = None
    cells = []
    for flags in combos:
        fn, part, part_lse = launcher(*shape, **flags)
        part.fill_(float("nan"))
        fn()
        torch.cuda.synchronize()
        got = (part.float().clone(), part_lse.clone())
        if ref is None:
            ref = got
        diff = max((got[0] - ref[0]).abs().max().item(), (got[1] - ref[1]).abs().max().item())
        us = [time_graph_us(fn, launches_per_graph=5, trials=10) for _ in range(2)]
        cells.append(f"{flags}: {us[0]:.1f}/{us[1]:.1f} us, max diff {diff:.2e}, nan {bool(got[0].isnan().any())}")
    print(shape, " | ".join(cells), flush=True)

fn, _, _ = launcher(64, 512, 16)
print("fresh:", f"{time_graph_us(fn, launches_per_graph=5, trials=15):.1f} us", clocks(), flush=True)
heavy, _, _ = launcher(32, 32768, 65)
end = time.time() + 6
while time.time() < end:
    heavy()
    torch.cuda.synchronize()
torch.cuda.synchronize()
print("after 6 s of load:", clocks(), f"{time_graph_us(fn, launches_per_graph=5, trials=15):.1f} us", clocks(), flush=True)
time.sleep(3)
print("3 s later:", f"{time_graph_us(fn, launches_per_graph=5, trials=15):.1f} us", clocks(), flush=True)
