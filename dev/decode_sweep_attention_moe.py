"""Dev sweep: tree_verify_mla split counts at decode shapes (both backends), and one fused MoE layer
with the shared experts inside its launches against the shared MLP run apart (Moonlight, Kimi K2).
Run from the repository root: PYTHONPATH=src:benchmarks python dev/decode_sweep_attention_moe.py OUT.json"""
import json
import sys
import torch
sys.path.insert(0, "benchmarks")
from common import time_graph_us
from ddtree.attention import tree_verify_mla
from ddtree.attention.api import choose_num_splits
from ddtree.tree import pack_visibility
from ddtree.ops.moe import SharedExperts, fused_moe
from ddtree.models.layers import MLP

torch.manual_seed(0)
dev = "cuda"
PAGE = 64
res = []

def attn(batch, heads, prefix, pages, splits, backend):
    kv = torch.randn(batch * pages + 1, PAGE, 576, device=dev).bfloat16()
    bt = torch.randperm(batch * pages, device=dev).view(batch, pages).int()
    q = torch.randn(batch, 1, heads, 576, device=dev).bfloat16()
    vis = pack_visibility(torch.ones(batch, 1, 1, dtype=torch.bool, device=dev))
    pl = torch.full((batch,), prefix, dtype=torch.int32, device=dev)
    nr = torch.ones(batch, dtype=torch.int32, device=dev)
    return lambda: tree_verify_mla(q, kv, bt, pl, nr, vis, 0.1, num_splits=splits, check=False, backend=backend)

for batch, heads, prefix in [(1, 16, 1024), (8, 16, 1024), (1, 64, 1024), (1, 16, 4096)]:
    pages = (prefix + 65 + PAGE - 1) // PAGE + 1
    auto = choose_num_splits(batch, heads, pages * PAGE, torch.device(dev), "hopper")
    for backend in ("hopper", "triton"):
        for splits in (1, 2, 4, 8, 16, 32):
            try:
                us = time_graph_us(attn(batch, heads, prefix, pages, splits, backend), launches_per_graph=27)
            except Exception as e:
                us = repr(e)[:100]
            r = dict(kind="attn", batch=batch, heads=heads, prefix=prefix, backend=backend, splits=splits, auto=auto, us=us)
            print(json.dumps(r), flush=True); res.append(r)

def moe_case(name, hidden, inter, experts, k, shared_n, tokens):
    dt = torch.bfloat16
    wgu = (torch.randn(experts, hidden, 2 * inter, device=dev) / hidden**0.5).to(dt)
    wd = (torch.randn(experts, inter, hidden, device=dev) / inter**0.5).to(dt)
    mlp = MLP(hidden, shared_n * inter).to(dev, dt)
    mlp.fuse_input_projections()
    x = torch.randn(tokens, hidden, device=dev).to(dt)
    ids = torch.stack([torch.randperm(experts, device=dev)[:k] for _ in range(tokens)])
    w = torch.rand(tokens, k, device=dev)
    sh = SharedExperts(mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight)
    with torch.no_grad():
        a = fused_moe(x, wgu, wd, w, ids, shared=sh)
        b = fused_moe(x, wgu, wd, w, ids) + mlp(x)
        err = float((a.float() - b.float()).norm() / b.float().norm())
        t_in = time_graph_us(lambda: fused_moe(x, wgu, wd, w, ids, shared=sh))
        t_apart = time_graph_us(lambda: fused_moe(x, wgu, wd, w, ids) + mlp(x))
        t_routed = time_graph_us(lambda: fused_moe(x, wgu, wd, w, ids))
    mb = (tokens and min(experts, tokens * k) + shared_n) * 3 * hidden * inter * 2 / 1e6
    r = dict(kind="moe", name=name, tokens=tokens, shared_in_us=t_in, shared_apart_us=t_apart, routed_only_us=t_routed,
             rel_err=err, approx_MB_if_all_distinct=mb)
    print(json.dumps(r), flush=True); res.append(r)

for tokens in (1, 8, 65):
    moe_case("moonlight", 2048, 1408, 64, 6, 2, tokens)
for tokens in (1, 8):
    moe_case("kimi-k2", 7168, 2048, 384, 8, 1, tokens)
json.dump(res, open(sys.argv[1], "w"), indent=1)
