"""The reference builder against hand-worked trees and an exhaustive enumeration of paths."""

import itertools
import math

import pytest
import torch

from ddtree.tree import build_trees
from ddtree.tree.reference import build_tree_one

from .helpers import make_draft, with_zero_probability


def test_hand_worked_tree():
    lp = torch.tensor([[[-0.125, -2.0], [-0.5, -1.0]]])
    tok = torch.tensor([[[10, 11], [20, 21]]])
    trees = build_trees(lp, tok, 4, backend="reference")
    # Pops: (0) -0.125, (0,0) -0.625, (0,1) -1.125, (1) -2.0.
    assert trees.tokens.tolist() == [[10, 20, 21, 11]]
    assert trees.parents.tolist() == [[0, 1, 1, 0]]
    assert trees.depths.tolist() == [[1, 2, 2, 1]]
    assert trees.num_nodes.tolist() == [4]
    assert trees.visibility.tolist() == [[[0b1], [0b11], [0b111], [0b1011], [0b10001]]]


def test_equal_weights_pop_in_path_order():
    # All log-probs 0: every path ties, so the rank-path tie-break alone orders them (preorder).
    lp = torch.zeros(1, 2, 2)
    tok = torch.tensor([[[1, 2], [3, 4]]])
    trees = build_trees(lp, tok, 6, backend="reference")
    assert trees.tokens.tolist() == [[1, 3, 4, 2, 3, 4]]
    assert trees.parents.tolist() == [[0, 1, 1, 0, 4, 4]]


def test_underfull_tree_pads_and_budget_cut():
    lp = torch.log(torch.tensor([[[0.75, 0.25], [0.5, 0.5]]]))
    tok = torch.tensor([[[5, 6], [7, 8]]])
    trees = build_trees(lp, tok, 9, backend="reference")  # only 2 + 4 paths exist
    assert trees.num_nodes.tolist() == [6]
    assert trees.tokens[0, 6:].tolist() == [-1, -1, -1]
    assert trees.parents[0, 6:].tolist() == [-1, -1, -1]
    assert trees.visibility[0, 7:].abs().sum() == 0
    assert build_trees(lp, tok, 1, backend="reference").tokens.tolist() == [[5]]


def test_zero_probability_candidates_are_never_pushed():
    inf = math.inf
    lp = torch.tensor([[[-0.5, -inf], [-inf, -inf]], [[-inf, -inf], [0.0, 0.0]]])
    tok = torch.tensor([[[1, 2], [3, 4]], [[1, 2], [3, 4]]])
    trees = build_trees(lp, tok, 4, backend="reference")
    assert trees.num_nodes.tolist() == [1, 0]
    assert trees.tokens.tolist() == [[1, -1, -1, -1], [-1, -1, -1, -1]]
    assert trees.visibility[1, 0].tolist() == [1]  # the root still sees itself


def _paths_by_enumeration(lp: list[list[float]], budget: int) -> list[tuple[int, ...]]:
    """All paths sorted by (-sum of log-probs, rank path): exact for integer-valued log-probs."""
    depth, k = len(lp), len(lp[0])
    paths = []
    for d in range(1, depth + 1):
        for ranks in itertools.product(range(k), repeat=d):
            w = sum(lp[i][r] for i, r in enumerate(ranks))
            if w > -math.inf:
                paths.append((-w, ranks))
    return [ranks for _, ranks in sorted(paths)[:budget]]


@pytest.mark.parametrize("seed", range(6))
def test_heap_order_equals_sorted_paths(seed):
    gen = torch.Generator().manual_seed(seed)
    depth, k = 1 + seed % 3, 2 + seed % 2
    lp = torch.randint(-4, 1, (depth, k), generator=gen).double().sort(dim=-1, descending=True).values
    if seed % 2:
        lp[-1, -1] = -math.inf
    rows = lp.tolist()
    budget = 1 + int(torch.randint(0, 40, (), generator=gen))
    nodes = build_tree_one(rows, budget)
    paths: list[tuple[int, ...]] = []
    for d, rank, parent in nodes:
        prefix = paths[parent - 1] if parent else ()
        assert len(prefix) == d - 1
        paths.append(prefix + (rank,))
    assert paths == _paths_by_enumeration(rows, budget)


@pytest.mark.parametrize("kind", ["normal", "bf16", "integer", "duplicated"])
def test_structure_and_visibility(kind):
    gen = torch.Generator().manual_seed(7)
    lp, tok = make_draft(kind, 3, 5, 40, 8, gen)
    lp = with_zero_probability(lp, gen)
    budget = 70
    trees = build_trees(lp, tok, budget, backend="reference")
    for r in range(3):
        n = int(trees.num_nodes[r])
        parents, depths = trees.parents[r].tolist(), trees.depths[r].tolist()
        for i in range(1, n + 1):
            p = parents[i - 1]
            assert 0 <= p < i, "a parent precedes its child"
            assert depths[i - 1] == (depths[p - 1] if p else 0) + 1
            expected = {i}
            while p:
                expected.add(p)
                p = parents[p - 1]
            expected.add(0)
            bits = {j for j in range(budget + 1) if (int(trees.visibility[r, i, j // 64]) >> (j % 64)) & 1}
            assert bits == expected
        assert (trees.visibility[r, n + 1 :] == 0).all()


def test_pack_visibility_matches_builder_rows():
    from ddtree.tree import pack_visibility

    gen = torch.Generator().manual_seed(4)
    lp, tok = make_draft("bf16", 2, 6, 50, 30, gen)
    trees = build_trees(lp, tok, 130, backend="reference")  # 131 rows: 3 words, bit 63 used
    for r in range(2):
        n = int(trees.num_nodes[r]) + 1
        seen = torch.zeros(131, 131, dtype=torch.bool)
        for i in range(n):
            j = i
            while True:
                seen[i, j] = True
                if j == 0:
                    break
                j = int(trees.parents[r, j - 1])
        assert torch.equal(pack_visibility(seen), trees.visibility[r])
