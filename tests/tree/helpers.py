"""Input makers for the tree tests: random and adversarial drafter log-probs; first_nodes, a
tree cut short (what budget="auto" stands on: engine/acceptance.py)."""

from __future__ import annotations

import torch

from ddtree.tree import TREE_FIELDS, DraftTrees, topk_logprobs
from ddtree.tree.types import visibility_words


def make_logits(kind: str, batch: int, depth: int, vocab: int, gen: torch.Generator) -> torch.Tensor:
    """Drafter logits [B, D, V] of a named kind; the tie-heavy kinds stress the heap tie-break."""
    if kind == "normal":
        return torch.randn(batch, depth, vocab, generator=gen) * 3
    if kind == "bf16":  # rounding to bf16 makes equal logits common, as in real drafts
        return (torch.randn(batch, depth, vocab, generator=gen) * 3).bfloat16()
    if kind == "integer":
        return torch.randint(-3, 3, (batch, depth, vocab), generator=gen).float()
    if kind == "equal":
        return torch.zeros(batch, depth, vocab)
    if kind == "duplicated":  # every column repeated: pairs of exactly tied tokens
        half = torch.randn(batch, depth, (vocab + 1) // 2, generator=gen)
        return half.repeat_interleave(2, dim=-1)[..., :vocab]
    if kind == "peaked":  # one dominant token per row: very negative tail log-probs
        logits = torch.randn(batch, depth, vocab, generator=gen)
        logits[..., 0] = 120.0
        return logits
    raise ValueError(kind)


def make_draft(
    kind: str, batch: int, depth: int, vocab: int, k: int, gen: torch.Generator, device: str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor]:
    """(top_logprobs float32 [B, D, k], top_tokens int64 [B, D, k]) on `device`."""
    lp, tok = topk_logprobs(make_logits(kind, batch, depth, vocab, gen), k)
    return lp.to(device), tok.to(device)


def with_zero_probability(lp: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Set a random suffix of ranks to -inf in random rows (probability-0 candidates), and a few
    rows entirely to -inf, keeping every row sorted."""
    lp = lp.clone()
    b, d, k = lp.shape
    cut = torch.randint(0, k + 1, (b, d), generator=gen)
    ranks = torch.arange(k).expand(b, d, k)
    hit = torch.rand(b, d, generator=gen) < 0.5
    lp[(ranks >= cut[..., None]) & hit[..., None]] = float("-inf")
    return lp


def assert_trees_equal(got: DraftTrees, want: DraftTrees, context: str = "") -> None:
    assert got.max_depth == want.max_depth
    for field in TREE_FIELDS:
        g, w = getattr(got, field).cpu(), getattr(want, field).cpu()
        assert g.shape == w.shape, f"{context} {field}: shape {tuple(g.shape)} != {tuple(w.shape)}"
        if not torch.equal(g, w):
            where = (g != w).nonzero()[0].tolist()
            raise AssertionError(
                f"{context} {field} differs first at {where}: got {g[tuple(where)].item()}, "
                f"want {w[tuple(where)].item()}; {int((g != w).sum())} elements differ"
            )


def path_posterior(trees: DraftTrees, gen: torch.Generator, follow: float = 0.8) -> torch.Tensor:
    """A posterior [B, budget + 1] that follows a random branch with probability `follow` at each
    node (choosing a random child's token) and otherwise picks a token no child has."""
    b, budget = trees.tokens.shape
    tokens, parents = trees.tokens.cpu(), trees.parents.cpu()
    post = torch.full((b, budget + 1), 10**9 + 7, dtype=torch.int64)  # a token no tree holds
    for r in range(b):
        n = int(trees.num_nodes[r])
        for node in range(n + 1):
            children = [i for i in range(1, n + 1) if int(parents[r, i - 1]) == node]
            if children and torch.rand((), generator=gen).item() < follow:
                pick = children[int(torch.randint(len(children), (), generator=gen))]
                post[r, node] = tokens[r, pick - 1]
    return post


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
