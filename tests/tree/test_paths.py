"""first_nodes and path_logprobs against the reference builder: a tree cut to n nodes is the tree
of budget n, and each node's path log-probability is the heap weight it was popped with."""

import math

import pytest
import torch

from ddtree.tree import build_trees, first_nodes, path_logprobs
from ddtree.tree.reference import build_tree_one

from .helpers import assert_trees_equal, make_draft, with_zero_probability


def heap_weights(lp: torch.Tensor, budget: int) -> list[list[float]]:
    """Per request, the float64 weight of every popped node, from the reference heap."""
    out = []
    for row in lp.double().tolist():
        k = min(len(row[0]), budget)
        nodes = build_tree_one([r[:k] for r in row], budget)
        weights = []
        for depth, rank, parent in nodes:
            weights.append((weights[parent - 1] if parent else 0.0) + row[depth - 1][rank])
        out.append(weights)
    return out


@pytest.mark.parametrize("kind", ["normal", "bf16", "integer", "peaked"])
@pytest.mark.parametrize("budget,n", [(16, 5), (64, 1), (64, 63), (70, 65)])
def test_first_nodes_equal_the_smaller_tree(kind, budget, n):
    gen = torch.Generator().manual_seed(budget * 7 + n)
    lp, tok = make_draft(kind, 3, 6, 50, min(budget, 50), gen)
    full = build_trees(lp, tok, budget, backend="reference")
    assert_trees_equal(first_nodes(full, n), build_trees(lp, tok, n, backend="reference"), f"{kind} n={n}")


def test_first_nodes_of_underfull_trees_and_bad_sizes():
    gen = torch.Generator().manual_seed(3)
    lp, tok = make_draft("normal", 4, 3, 8, 8, gen)
    lp = with_zero_probability(lp, gen)
    full = build_trees(lp, tok, 24, backend="reference")
    assert_trees_equal(first_nodes(full, 9), build_trees(lp, tok, 9, backend="reference"))
    assert first_nodes(full, 24) is full
    for bad in (0, 25):
        with pytest.raises(ValueError, match="n must be in"):
            first_nodes(full, bad)


@pytest.mark.parametrize("kind", ["normal", "bf16", "integer", "peaked"])
def test_path_logprobs_are_the_heap_weights(kind):
    gen = torch.Generator().manual_seed(11)
    lp, tok = make_draft(kind, 5, 7, 40, 40, gen)
    lp = with_zero_probability(lp, gen) if kind == "normal" else lp
    budget = 70
    trees = build_trees(lp, tok, budget, backend="reference")
    got = path_logprobs(trees, lp, tok)
    assert got.dtype == torch.float32 and got.shape == (5, budget)
    for r, weights in enumerate(heap_weights(lp, budget)):
        n = int(trees.num_nodes[r])
        assert n == len(weights)
        assert torch.isneginf(got[r, n:]).all()
        assert got[r, :n].tolist() == pytest.approx(weights, rel=1e-5, abs=1e-4)
        assert all(a >= b - 1e-4 for a, b in zip(got[r, :n].tolist(), got[r, 1:n].tolist()))  # pop order


def test_path_logprobs_of_an_empty_tree_and_a_chain():
    lp = torch.tensor([[[-0.1, -3.0], [-0.2, -2.0], [-0.3, -1.5]]])
    tok = torch.tensor([[[5, 6], [7, 8], [9, 4]]])
    chain = build_trees(lp[..., :1].contiguous(), tok[..., :1].contiguous(), 3, backend="reference")
    assert path_logprobs(chain, lp, tok)[0].tolist() == pytest.approx([-0.1, -0.3, -0.6])
    empty = build_trees(torch.full_like(lp, -math.inf), tok, 4, backend="reference")
    assert torch.isneginf(path_logprobs(empty, lp, tok)).all()
