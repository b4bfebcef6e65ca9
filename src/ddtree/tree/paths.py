"""A tree cut short. Best-first pop order does not depend on the budget, so the first n nodes of
a tree are exactly the tree of budget n. budget="auto" stands on this: a round that verified V
nodes says what a round of any n <= V nodes would have committed (engine/acceptance.py).
"""

from __future__ import annotations

from .types import DraftTrees, visibility_words


def first_nodes(trees: DraftTrees, n: int) -> DraftTrees:
    """The trees of budget `n` (1 <= n <= trees.budget): each tree's first n nodes, as contiguous
    tensors of the sizes build_trees(..., n) returns. Nodes are numbered in pop order and a parent
    precedes its child, so the first n + 1 visibility rows only set bits below n + 1."""
    if not 1 <= n <= trees.budget:
        raise ValueError(f"n must be in [1, {trees.budget}], got {n}")
    if n == trees.budget:
        return trees
    return DraftTrees(
        tokens=trees.tokens[:, :n].contiguous(),
        parents=trees.parents[:, :n].contiguous(),
        depths=trees.depths[:, :n].contiguous(),
        num_nodes=trees.num_nodes.clamp_max(n),
        visibility=trees.visibility[:, : n + 1, : visibility_words(n)].contiguous(),
        max_depth=trees.max_depth,
    )
