"""Dev: one graphed engine round under variants of the kernel policy and the fused MoE's tiles, each
timed and profiled in one process (benchmarks/profile_round.py is the committed benchmark). Run
from the repository root with PYTHONPATH=src:benchmarks.

usage: round_variants.py OUT.json BATCH BUDGET variant [variant ...]

A variant is 'base' (the defaults) or comma-separated key=value pairs:
    skinny=0|1     the few-row GEMM kernel off / on (KernelPolicy.gemm_max_rows 0 or its default)
    pdl=0|1        programmatic dependent launch (KernelPolicy.pdl)
    direct=N       the fused MoE's direct mode up to N tokens (KernelPolicy.moe_direct_max_tokens)
    narrow=NxK, wide=NxK, stages=S   fused MoE tiles (ops/moe.py's NARROW_TILES, BLOCK_N x BLOCK_K,
                   NUM_STAGES: kernel constants, set here for the sweep only)
"""
import json, sys
import torch
sys.path.insert(0, "benchmarks")
from profile_round import kernel_table
from round_setup import PrefixBatch, build_pair
from ddtree.engine.round import RoundPlan, run_round
from ddtree.engine.timing import StageTimer
from ddtree.ops import KernelPolicy, apply_policy
from ddtree.ops import moe as fused_moe

out, batch, budget, variants = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4:] or ["base"]
dev = torch.device("cuda")
tiles = dict(narrow=fused_moe.NARROW_TILES, stages=fused_moe.NUM_STAGES, wide=(fused_moe.BLOCK_N, fused_moe.BLOCK_K))


def apply(variant, models):
    fused_moe.NARROW_TILES, fused_moe.NUM_STAGES = tiles["narrow"], tiles["stages"]
    fused_moe.BLOCK_N, fused_moe.BLOCK_K = tiles["wide"]
    policy = KernelPolicy()
    for kv in ([] if variant == "base" else variant.split(",")):
        k, v = kv.split("=")
        if k == "skinny":
            policy = policy.but(gemm_max_rows=KernelPolicy().gemm_max_rows if v == "1" else 0)
        elif k == "pdl":
            policy = policy.but(pdl=v == "1")
        elif k == "direct":
            policy = policy.but(moe_direct_max_tokens=int(v))
        elif k == "narrow":
            fused_moe.NARROW_TILES = tuple(int(a) for a in v.split("x"))
        elif k == "wide":
            fused_moe.BLOCK_N, fused_moe.BLOCK_K = (int(a) for a in v.split("x"))
        elif k == "stages":
            fused_moe.NUM_STAGES = int(v)
        else:
            raise SystemExit(f"unknown variant key {k!r}")
    for model in models:
        apply_policy(model, policy)

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
        apply(variant, (target, drafter))
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
    apply("base", (target, drafter))
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
