"""Dev sweep: skinny_matmul tile configs against cuBLAS at decode GEMM shapes. Each shape repeats one
weight, so weights under the 50 MB L2 stay cached: relative, not absolute, numbers.
Run from the repository root: PYTHONPATH=src:benchmarks python dev/decode_sweep_skinny.py OUT.json"""
import itertools
import json
import sys
import time
import torch
import torch.nn.functional as F
sys.path.insert(0, "benchmarks")
from common import time_graph_us
from ddtree.ops.gemm import skinny_matmul

dev, dt = "cuda", torch.bfloat16
torch.manual_seed(0)

def lin(m, k, n):
    x = torch.randn(m, k, device=dev, dtype=dt)
    w = torch.randn(n, k, device=dev, dtype=dt) / k**0.5
    return (lambda: F.linear(x, w)), x[None], w.t()[None], n * k * 2, None

def router(m, k, n):
    x = torch.randn(m, k, device=dev, dtype=dt)
    w = torch.randn(n, k, device=dev, dtype=dt) / k**0.5
    return (lambda: torch.mm(x, w.t(), out_dtype=torch.float32)), x[None], w.t()[None], n * k * 2, torch.float32

def uk(m, heads, nope=128, latent=512):
    q = torch.randn(m, heads, nope + 64, device=dev, dtype=dt)
    wkv = torch.randn(heads, nope + 128, latent, device=dev, dtype=dt) / nope**0.5
    x, w = q[..., :nope].transpose(0, 1), wkv[:, :nope]
    return (lambda: torch.bmm(x, w)), x, w, heads * nope * latent * 2, None

def uv(m, heads, nope=128, latent=512):
    o = torch.randn(m, heads, latent, device=dev, dtype=dt)
    wkv = torch.randn(heads, nope + 128, latent, device=dev, dtype=dt) / latent**0.5
    x, w = o.transpose(0, 1), wkv[:, nope:].transpose(1, 2)
    return (lambda: torch.bmm(x, w)), x, w, heads * 128 * latent * 2, None

shapes = {
    "ml_qkv_m1": lin(1, 2048, 3648), "ml_oproj_m1": lin(1, 2048, 2048), "ml_router_m1": router(1, 2048, 64),
    "ml_uk_m1": uk(1, 16), "ml_uv_m1": uv(1, 16), "ml_dense_gu_m1": lin(1, 2048, 22528), "ml_dense_down_m1": lin(1, 11264, 2048),
    "ml_qkv_m8": lin(8, 2048, 3648), "ml_oproj_m8": lin(8, 2048, 2048), "ml_router_m8": router(8, 2048, 64),
    "ml_uk_m8": uk(8, 16), "ml_uv_m8": uv(8, 16),
    "k2_qa_m1": lin(1, 7168, 2112), "k2_qb_m1": lin(1, 1536, 12288), "k2_oproj_m1": lin(1, 8192, 7168),
    "k2_router_m1": router(1, 7168, 384), "k2_uk_m1": uk(1, 64), "k2_uv_m1": uv(1, 64),
}
configs = list(itertools.product((16, 32, 64), (128, 256, 512), (3, 5), (2, 4)))
res = []
t0 = time.time()
for name, (ref, x, w, nbytes, odt) in shapes.items():
    want = ref().float()
    cub = time_graph_us(ref)
    best = None
    for bn, bk, st, wp in configs:
        try:
            got = skinny_matmul(x, w, out_dtype=odt, block_n=bn, block_k=bk, num_stages=st, num_warps=wp)
            err = float((got.float().reshape(want.shape) - want).norm() / want.norm())
            us = time_graph_us(lambda: skinny_matmul(x, w, out_dtype=odt, block_n=bn, block_k=bk, num_stages=st, num_warps=wp))
        except Exception as e:
            us, err = None, repr(e)[:80]
        r = dict(shape=name, bn=bn, bk=bk, stages=st, warps=wp, us=us, err=err)
        res.append(r)
        if us is not None and (best is None or us < best["us"]):
            best = r
    auto = time_graph_us(lambda: skinny_matmul(x, w, out_dtype=odt))
    line = dict(shape=name, cublas_us=cub, auto_us=auto, best=best, MB=nbytes / 1e6, floor_us=nbytes / 4.15e6)
    res.append(line)
    print(json.dumps(line), f"t={time.time()-t0:.0f}s", flush=True)
json.dump(res, open(sys.argv[1], "w"))
