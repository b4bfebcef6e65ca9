"""Where the Triton builder's time goes: variants and ablations at B = 64, D = 15 (dev notes).

Not a results script: it prints one table for docs/notes/tree_builder.md. Run on a GPU:
    PYTHONPATH=src python dev/tree_builder_ablation.py
"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from common import time_events_us, time_graph_us  # noqa: E402

from ddtree.tree import TREE_FIELDS, topk_logprobs  # noqa: E402
from ddtree.tree.build_triton import build_trees_triton  # noqa: E402
from ddtree.tree.reference import build_trees_reference  # noqa: E402


def draft(batch, depth, budget, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    logits = (torch.randn(batch, depth, 4096, device="cuda", generator=gen) * 3).bfloat16()
    return topk_logprobs(logits, budget)


def row(name, lp, tok, budget, **kw):
    out = build_trees_triton(lp, tok, budget, **kw)
    ref = build_trees_reference(lp, tok, budget)
    exact = all(torch.equal(getattr(out, f), getattr(ref, f)) for f in TREE_FIELDS)
    us = time_graph_us(lambda: build_trees_triton(lp, tok, budget, **kw))
    depth = int(out.depths.max())
    print(f"| {name} | {budget} | {kw} | {us:.1f} | {exact} | {depth} |", flush=True)


print("| case | budget | options | us | bit-exact | max depth |\n|---|---|---|---|---|---|")
for budget in (16, 64, 512):
    lp, tok = draft(64, 15, budget)
    for warps in ((1, 2) if budget <= 64 else (2, 4)):
        row("B64 D15", lp, tok, budget, num_warps=warps)
lp, tok = draft(64, 15, 64)
dead = lp.clone()
dead[:, 0, :] = float("-inf")  # empty trees: the loop runs with no loads and no pops
row("empty trees", dead, tok, 64, num_warps=1)
lp1, tok1 = draft(64, 1, 64)
row("D=1 (flat)", lp1, tok1, 64, num_warps=1)
row("budget 1", lp, tok, 1, num_warps=1)
chain_lp, chain_tok = draft(64, 15, 1)
row("chain K=1", chain_lp, chain_tok, 15, num_warps=1)

print("\n| top-k variant (B64 D15 V163840 bf16) | k | us |\n|---|---|---|")
gen = torch.Generator(device="cuda").manual_seed(1)
logits = torch.randn(64, 15, 163840, device="cuda", generator=gen).bfloat16()
for k in (64, 512):
    for name, fn in [
        ("torch.topk values only (bf16)", lambda: torch.topk(logits, k, dim=-1)),
        ("topk_logprobs triton", lambda: topk_logprobs(logits, k, backend="triton")),
        ("topk_logprobs reference", lambda: topk_logprobs(logits, k, backend="reference")),
        ("log_softmax(float) + topk", lambda: torch.log_softmax(logits.float(), -1).topk(k, dim=-1)),
    ]:
        print(f"| {name} | {k} | {time_events_us(fn, trials=10):.0f} |", flush=True)
    a = topk_logprobs(logits, k, backend="triton")
    b = topk_logprobs(logits, k, backend="reference")
    print(f"tokens equal: {torch.equal(a[1], b[1])}, max |dlp| {(a[0] - b[0]).abs().max().item():.2e}")
