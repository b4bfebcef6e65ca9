"""The Triton builder must return exactly the reference's trees (runs interpreted on the CPU)."""

import zlib

import pytest
import torch

from ddtree.tree import TREE_FIELDS, build_trees, empty_trees

from ..conftest import HAS_CUDA, gpu_or_scaled
from .helpers import assert_trees_equal, make_draft, make_logits, with_zero_probability


POISON = -7_777_777  # no valid output is ever this: an unwritten element shows


def _check(lp, tok, budget, device, context):
    want = build_trees(lp, tok, budget, backend="reference")
    out = empty_trees(lp.shape[0], budget, lp.shape[1], device)
    for field in TREE_FIELDS:
        getattr(out, field).fill_(POISON)
    got = build_trees(lp.to(device), tok.to(device), budget, backend="triton", out=out)
    assert got is out
    assert_trees_equal(got, want, context)
    return want


# (kind, B, D, V, K, budget): fresh random inputs and the named edge cases.
CASES = [
    ("normal", 3, 4, 30, 12, 12),
    ("bf16", 2, 6, 50, 20, 20),
    ("integer", 3, 3, 12, 12, 24),  # exact ties everywhere
    ("equal", 2, 3, 5, 5, 30),  # all logits equal: pure rank-path order
    ("duplicated", 2, 4, 16, 16, 16),  # tied token pairs
    ("peaked", 2, 5, 20, 6, 18),  # very negative log-probs
    ("normal", 2, 5, 20, 4, 25),  # K < budget
    ("integer", 2, 2, 3, 3, 40),  # underfull: 3 + 9 paths < budget
    ("normal", 3, 7, 10, 1, 5),  # chains (K = 1), some cut by budget
    ("normal", 2, 1, 10, 10, 6),  # depth 1
    ("bf16", 3, 5, 10, 10, 1),  # budget 1
    ("bf16", 1, 31, 40, 40, 40),  # D = 31
]


@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}-B{c[1]}-D{c[2]}-K{c[4]}-n{c[5]}" for c in CASES])
def test_matches_reference(case, kernel_device):
    kind, b, d, v, k, budget = case
    gen = torch.Generator().manual_seed(zlib.crc32(str(case).encode()))
    lp, tok = make_draft(kind, b, d, v, k, gen)
    _check(lp, tok, budget, kernel_device, str(case))


def test_zero_probability_and_mixed_fill(kernel_device):
    gen = torch.Generator().manual_seed(11)
    lp, tok = make_draft("bf16", 6, 4, 12, 12, gen)
    lp = with_zero_probability(lp, gen)
    lp[0, :, 1:] = float("-inf")  # a chain of 4 nodes
    lp[1, 0, :] = float("-inf")  # an empty tree
    want = _check(lp, tok, 30, kernel_device, "zero-probability")
    filled = want.num_nodes == 30
    assert filled.any() and not filled.all(), "the batch must mix full and underfull trees"


def test_wide_k_uses_first_budget_ranks(kernel_device):
    gen = torch.Generator().manual_seed(3)
    lp, tok = make_draft("normal", 2, 3, 64, 64, gen)
    _check(lp, tok, 9, kernel_device, "K > budget")
    # Non-contiguous inputs (a rank slice) are read through their strides.
    _check(lp[:, :, :20], tok[:, :, :20], 20, kernel_device, "strided")


@pytest.mark.parametrize("budget", [gpu_or_scaled((512,), (128,), "large-budget")])
def test_large_budget_single_request(budget, kernel_device):
    gen = torch.Generator().manual_seed(5)
    lp, tok = make_draft("bf16", 1, 31, 600, budget, gen)
    _check(lp, tok, budget, kernel_device, f"budget {budget}, D 31")


def test_large_batch_small_trees(kernel_device):
    gen = torch.Generator().manual_seed(6)
    lp, tok = make_draft("integer", 256, 3, 6, 4, gen)
    _check(lp, tok, 4, kernel_device, "B 256")


# Served sizes on a GPU; on the CPU, where the interpreter runs one program (request) at a time
# and each node costs a step, the same mix of batch, budget and depth scaled down to seconds.
@pytest.mark.parametrize("batch,budget,depth", [
    gpu_or_scaled((256, 512, 15), (2, 12, 15), "wide-batch"),
    gpu_or_scaled((64, 64, 31), (1, 20, 31), "depth-31"),
    gpu_or_scaled((256, 1024, 7), (4, 8, 7), "largest-budget"),
    gpu_or_scaled((17, 333, 15), (3, 11, 15), "odd-sizes"),
])
def test_served_sizes(batch, budget, depth, kernel_device):
    gen = torch.Generator().manual_seed(batch + budget)
    for kind in ("bf16", "integer", "peaked"):
        lp, tok = make_draft(kind, batch, depth, 2048, min(budget, 2048), gen)
        lp = with_zero_probability(lp, gen) if kind == "peaked" else lp
        _check(lp, tok, budget, kernel_device, f"{kind} B{batch} n{budget} D{depth}")


@pytest.mark.cuda
def test_graph_capture_replays_new_inputs():
    """Top-k, the builder and the accept walk capture into one CUDA graph (no sync, no
    data-dependent allocation) and a replay on new logits still matches the reference."""
    from ddtree.tree import accept_paths

    from ddtree.tree import topk_logprobs

    gen = torch.Generator().manual_seed(0)
    logits = make_logits("bf16", 8, 15, 500, gen).cuda()
    post = torch.zeros(8, 65, dtype=torch.int64, device="cuda")
    build_trees(*topk_logprobs(logits, 64), 64)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        lp, tok = topk_logprobs(logits, 64)
        trees = build_trees(lp, tok, 64)
        accepted, accept_len, bonus = accept_paths(trees, post)
    logits2 = make_logits("integer", 8, 15, 500, gen)
    lp2, tok2 = topk_logprobs(logits2, 64, backend="reference")
    logits.copy_(logits2)
    post.copy_(tok2[:, 0, :1].expand(8, 65))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(tok.cpu(), tok2)
    want = build_trees(lp.cpu(), tok2, 64, backend="reference")
    assert_trees_equal(trees, want, "graph replay")
    ref_walk = accept_paths(want, post.cpu(), backend="reference")
    for got, exp in zip((accepted, accept_len, bonus), ref_walk):
        assert torch.equal(got.cpu(), exp)


@pytest.mark.skipif(HAS_CUDA, reason="checks the CPU error path")
def test_triton_on_cpu_without_interpreter_is_refused(monkeypatch):
    from triton import knobs

    monkeypatch.setattr(knobs.runtime, "interpret", False)
    lp, tok = make_draft("normal", 1, 2, 5, 5, torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        build_trees(lp, tok, 4, backend="triton")
    from ddtree.tree import topk_logprobs

    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        topk_logprobs(torch.zeros(1, 2, 5), 2, backend="triton")
