"""First look at tree_verify_mla on a GPU: correctness at one small shape, speed at the bar shapes."""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from common import time_events_us  # noqa: E402

from ddtree.attention import tree_verify_mla, tree_verify_mla_reference  # noqa: E402


def make(batch, prefix, rows, heads, page=64, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    pages_per = (prefix + rows + page - 1) // page
    kv = torch.randn(batch * pages_per, page, 576, device="cuda", generator=gen).bfloat16()
    bt = torch.randperm(batch * pages_per, device="cuda", generator=gen).view(batch, pages_per).int()
    q = torch.randn(batch, rows, heads, 576, device="cuda", generator=gen).bfloat16()
    vis = torch.zeros(batch, rows, (rows + 63) // 64, dtype=torch.int64, device="cuda")
    for n in range(rows):  # a chain: row n sees rows 0..n
        for j in range(n + 1):
            vis[:, n, j // 64] |= 1 << (j % 64) if j % 64 < 63 else -(1 << 63)
    pl = torch.full((batch,), prefix, dtype=torch.int32, device="cuda")
    nn = torch.full((batch,), rows, dtype=torch.int32, device="cuda")
    return q, kv, bt, pl, nn, vis


q, kv, bt, pl, nn, vis = make(2, 300, 65, 64)
out, lse = tree_verify_mla(q, kv, bt, pl, nn, vis, 0.1)
ro, rl = tree_verify_mla_reference(q, kv, bt, pl, nn, vis, 0.1)
print("rel err", ((out.double() - ro).norm() / ro.norm()).item(), "nan", torch.isnan(out).any().item())
for batch, prefix, rows in [(32, 4096, 65), (1, 32768, 16), (8, 4096, 65), (64, 512, 16)]:
    q, kv, bt, pl, nn, vis = make(batch, prefix, rows, 64)
    us = time_events_us(lambda: tree_verify_mla(q, kv, bt, pl, nn, vis, 0.1, check=False), trials=10)
    flops = 2 * batch * rows * 64 * (prefix + rows) * (576 + 512)
    print(f"B{batch} prefix{prefix} N{rows}: {us:.0f} us, {flops / us / 1e6:.0f} TFLOP/s", flush=True)
