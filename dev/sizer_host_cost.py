"""Host microseconds of the sizer's per-round work (TreeSizer.choose, learn, observe_step) on a synthetic
ledger, at 1 and 32 requests: what budget="auto" adds to each round on the host (CPU only).

    PYTHONPATH=src python dev/sizer_host_cost.py
"""
import time, numpy as np
from types import SimpleNamespace
from ddtree.engine.sizing import TreeSizer
from ddtree.engine.costs import RoundCosts
from ddtree.engine.round import result_width
sizes=(1,2,4,8,16,32,64)
table=RoundCosts({}, {b:{s:(0.3e-3 if s==0 else 1.1e-3+s*1e-5) for s in (0,)+sizes} for b in (1,2,4,8,16,32)})
for B in (1,32):
    sz=TreeSizer(sizes, 15, table)
    req=[SimpleNamespace(remaining_tokens=lambda: 100, accepted_nodes=0.0, expected_nodes=0.0) for _ in range(B)]
    w=result_width(15,0)
    res=np.zeros((B, w+16),dtype=np.int64); res[:,0]=4; res[:,w:w+4]=[0,1,2,3]; res[:,w+4:]=-1
    plan=SimpleNamespace(paths=True, experts=False, budget=64)
    slots=list(range(B))
    for _ in range(50):
        sz.learn(req,slots,res,plan,0); sz.choose(B,req,0.0,0)
    n=2000; t=time.perf_counter()
    for _ in range(n): sz.choose(B,req,0.0,0)
    c=(time.perf_counter()-t)/n
    t=time.perf_counter()
    for _ in range(n): sz.learn(req,slots,res,plan,0)
    l=(time.perf_counter()-t)/n
    t=time.perf_counter()
    for _ in range(n): sz.observe_step(B,8,1.2e-3)
    o=(time.perf_counter()-t)/n
    print(B, 'choose %.1f us learn %.1f us observe %.1f us'%(c*1e6,l*1e6,o*1e6))
