"""What a built tree says beyond its shape: each node's path probability, and the tree cut short.

Both serve the engine's choice of tree size (engine/sizing.py): a tree is built once at the
largest size the engine may verify, each node's path log-probability (the best-first heap's
weight) tells how likely the target is to accept it, and the verify takes the first n nodes.
Best-first pop order does not depend on the budget, so the first n nodes of a tree are exactly
the tree of budget n.
"""

from __future__ import annotations

import torch

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


def path_logprobs(trees: DraftTrees, top_logprobs: torch.Tensor, top_tokens: torch.Tensor) -> torch.Tensor:
    """float32 [B, budget]: node i's path log-probability under the drafter (its own log-prob at its
    depth plus its ancestors'), -inf past num_nodes. Node weights are non-increasing in pop order.

    trees: built from top_logprobs float32 [B, D, K] / top_tokens int64 [B, D, K] (the builder's
    inputs). No host synchronization: written for capture in a CUDA graph.
    """
    b, n = trees.tokens.shape
    k = top_logprobs.shape[2]
    level = (trees.depths.clamp_min(1) - 1)[..., None].expand(b, n, k)  # [B, n, K]
    at_depth_tokens = top_tokens.gather(1, level)
    at_depth_logprobs = top_logprobs.gather(1, level)
    rank = (at_depth_tokens == trees.tokens[..., None]).to(torch.int8).argmax(-1, keepdim=True)  # [B, n, 1]
    own = at_depth_logprobs.gather(2, rank)[..., 0]  # [B, n]
    valid = torch.arange(n, device=own.device)[None, :] < trees.num_nodes[:, None]
    own = torch.where(valid, own, 0.0)
    # Row i + 1 of the visibility bitmask marks node i + 1's ancestors (itself included).
    bit = torch.arange(64, device=own.device)
    words = trees.visibility[:, 1:, :, None] >> bit  # [B, n, words, 64]
    ancestors = (words & 1).bool().flatten(2)[:, :, 1 : n + 1]  # [B, n, n]: columns are nodes 1..n
    path = torch.where(ancestors, own[:, None, :], 0.0).sum(-1)
    return torch.where(valid, path, float("-inf"))
