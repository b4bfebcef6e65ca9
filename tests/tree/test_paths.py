"""first_nodes against the reference builder: a tree cut to n nodes is the tree of budget n (what
budget="auto" stands on, engine/acceptance.py)."""

import pytest
import torch

from ddtree.tree import build_trees

from .helpers import assert_trees_equal, first_nodes, make_draft, with_zero_probability


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
