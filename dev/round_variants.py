"""Dev: one graphed engine round under variants of module constants, each timed and profiled in one
process (benchmarks/profile_round.py is the committed benchmark). Run from the repository root
with PYTHONPATH=src:benchmarks.

usage: round_variants.py OUT.json BATCH BUDGET variant [variant ...]

A variant is 'base' (the defaults) or comma-separated key=value pairs:
    skinny=0|1     the few-row GEMM kernel (skinny.MAX_ROWS) off / on
    pdl=0|1        programmatic dependent launch (ddtree.pdl.ENABLED)
    attnpdl=0      the attention and its split merge launched without PDL
    fold=0         the MoE's expert sum in its own launch, not in the next norm (MoE.forward's
                   unsummed ignored)
    direct=0|1     the fused MoE's one-token direct mode (fused_moe.DIRECT_MAX_TOKENS 0 or 1)
    narrow=NxK, wide=NxK, stages=S   fused MoE tiles (NARROW_TILES, BLOCK_N x BLOCK_K, NUM_STAGES)
"""
import json, sys
import torch
sys.path.insert(0, "benchmarks")
from profile_round import kernel_table
from round_setup import PrefixBatch, build_pair
from ddtree.engine.round import RoundPlan, run_round
from ddtree.engine.timing import StageTimer
from ddtree import pdl
from ddtree.attention import api as attention_api
from ddtree.models import moe as moe_module
from ddtree.models import fused_moe, skinny

out, batch, budget, variants = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4:] or ["base"]
dev = torch.device("cuda")
defaults = dict(pdl=pdl.ENABLED, direct=fused_moe.DIRECT_MAX_TOKENS, max_rows=skinny.MAX_ROWS, narrow=fused_moe.NARROW_TILES, stages=fused_moe.NUM_STAGES, wide=(fused_moe.BLOCK_N, fused_moe.BLOCK_K))

launch_flags, moe_forward = attention_api.launch_flags, moe_module.MoE.forward


def apply(variant):
    attention_api.launch_flags, moe_module.MoE.forward = launch_flags, moe_forward
    skinny.MAX_ROWS = defaults["max_rows"]
    pdl.ENABLED, fused_moe.DIRECT_MAX_TOKENS = defaults["pdl"], defaults["direct"]
    fused_moe.NARROW_TILES, fused_moe.NUM_STAGES = defaults["narrow"], defaults["stages"]
    fused_moe.BLOCK_N, fused_moe.BLOCK_K = defaults["wide"]
    if variant == "base":
        return
    for kv in variant.split(","):
        k, v = kv.split("=")
        if k == "skinny":
            skinny.MAX_ROWS = defaults["max_rows"] if v == "1" else 0
        elif k == "pdl":
            pdl.ENABLED = v == "1"
        elif k == "attnpdl":
            attention_api.launch_flags = lambda device: dict(PDL=False, launch_pdl=False)
        elif k == "fold":
            moe_module.MoE.forward = lambda self, x, router_ids=None, unsummed=False: moe_forward(self, x, router_ids)
        elif k == "direct":
            fused_moe.DIRECT_MAX_TOKENS = int(v)
        elif k == "narrow":
            fused_moe.NARROW_TILES = tuple(int(a) for a in v.split("x"))
        elif k == "wide":
            fused_moe.BLOCK_N, fused_moe.BLOCK_K = (int(a) for a in v.split("x"))
        elif k == "stages":
            fused_moe.NUM_STAGES = int(v)
        else:
            raise SystemExit(f"unknown variant key {k!r}")

results = {}
with torch.no_grad():
    target, drafter, perm, info = build_pair("moonlight-16b-a3b", None, dev)
    pb = PrefixBatch(target, drafter, batch, 1024, 65)
    depth = pb.max_depth
    pb.set_budget(budget)
    plan = RoundPlan(bucket=batch, budget=budget, k=budget, any_sampled=False, any_filtered=False,
                     key_limit=pb.key_limit if budget else None, features=budget > 0, experts=True)
    run = lambda: run_round(pb.ctx, pb.state, plan, depth, StageTimer(dev, enabled=False))
    # Capture every variant's graph first, then time them interleaved (rounds of 10 replays each,
    # in turn) so that clock or thermal drift falls on all alike. Correctness: the round's result
    # and every layer's latent cache after a replay must equal the first variant's eager run, bit
    # for bit (a kernel reading its input before its producer finished would show here).
    ref = ref_cache = None
    graphs = {}
    for i, variant in enumerate(variants):
        apply(variant)
        s = torch.cuda.Stream(); s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            pb.restore(); first = run().clone()
        torch.cuda.current_stream().wait_stream(s); torch.cuda.synchronize()
        if ref is None:
            ref, ref_cache = first, [c.clone() for c in pb.caches]
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=s):
            pb.restore(); res = run()
        torch.cuda.synchronize()
        graphs[f"{i}:{variant}"] = (g, res)
    apply("base")
    st, en = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = {name: [] for name in graphs}
    for rnd in range(13):
        for name, (g, _) in graphs.items():
            for _ in range(10):
                st.record(); g.replay(); en.record(); en.synchronize()
                if rnd >= 3:  # the first rounds warm up
                    times[name].append(st.elapsed_time(en))
    for name, (g, res) in graphs.items():
        same = True
        for _ in range(10):
            g.replay(); torch.cuda.synchronize()
            same &= bool(torch.equal(res, ref)) and all(torch.equal(c, r) for c, r in zip(pb.caches, ref_cache))
        ts = sorted(times[name])
        rows = kernel_table(g, 5)
        total = sum(r[2] for r in rows)
        q = lambda f: ts[int(f * (len(ts) - 1))]
        print(f"[{name}] B={batch} budget={budget}: replay median {q(0.5):.3f} ms (p10 {q(0.1):.3f}, p90 {q(0.9):.3f}, "
              f"{len(ts)} interleaved); {sum(r[1] for r in rows):.0f} kernels, {total/1e3:.3f} ms kernel time; "
              f"result and caches equal to the first variant's eager run in 10 replays: {same}", flush=True)
        for r in rows[:14]:
            print(f"   {r[2]:9.1f} us {r[1]:6.0f}x  {r[0]}")
        results[name] = dict(replay_ms=ts, kernels=rows, same_result=same)
json.dump(results, open(out, "w"), indent=0)
