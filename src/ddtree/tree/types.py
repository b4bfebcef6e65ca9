"""DraftTrees, the builder's output, and the checks every backend shares at its boundary."""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Sentinel for columns past a tree's num_nodes (tokens, parents, depths) and for unused
# accept-path slots.
PAD = -1

# The Triton builder packs rank into 10 bits, parent, slot and heap order into 11 bits and depth
# into 6 bits (see build_triton.py); the reference has no such limit.
MAX_TRITON_BUDGET = 1024
MAX_TRITON_DEPTH = 63

# The per-request tensors of a DraftTrees, in declaration order.
TREE_FIELDS = ("tokens", "parents", "depths", "num_nodes", "visibility")


def visibility_words(budget: int) -> int:
    """Number of int64 words per visibility row: ceil((budget + 1) / 64)."""
    return (budget + 1 + 63) // 64


@dataclass
class DraftTrees:
    """A batch of draft trees, one per request (numbering: ../../docs/architecture.md).

    Node 0 is the root (the last committed bonus token); nodes 1..n are numbered in pop order,
    so a parent always precedes its child. Column i-1 of the per-node tensors is node i.

    Attributes:
        tokens:     int64 [B, budget]  drafted token of node i; PAD past num_nodes.
        parents:    int64 [B, budget]  parent node index (0 = root); PAD past num_nodes.
        depths:     int64 [B, budget]  depth >= 1 (the root has depth 0); PAD past num_nodes.
        num_nodes:  int64 [B]          nodes in each tree, 0..budget (root not counted).
        visibility: int64 [B, budget + 1, ceil((budget + 1) / 64)]  packed ancestor bitmask:
                    bit j of word j // 64 in row i is set when node j is i or an ancestor of i.
                    Rows past num_nodes are all zero.
        max_depth:  D, the draft depth the trees were built for (accepted paths have D + 1 slots).
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    depths: torch.Tensor
    num_nodes: torch.Tensor
    visibility: torch.Tensor
    max_depth: int

    def to(self, device: torch.device | str) -> "DraftTrees":
        """The same trees with every tensor on `device`."""
        moved = {name: getattr(self, name).to(device) for name in TREE_FIELDS}
        return DraftTrees(**moved, max_depth=self.max_depth)

    @property
    def budget(self) -> int:
        return self.tokens.shape[1]

    @property
    def batch_size(self) -> int:
        return self.tokens.shape[0]


def pack_visibility(seen: torch.Tensor) -> torch.Tensor:
    """Pack a bool mask [..., N, N] (row i sees column j) into int64 words [..., N, ceil(N / 64)]
    with the bitmask layout of DraftTrees.visibility (bit j of word j // 64)."""
    n = seen.shape[-1]
    words = (n + 63) // 64
    padded = torch.nn.functional.pad(seen.to(torch.int64), (0, words * 64 - n))
    bits = padded.view(*seen.shape[:-1], words, 64)
    weights = torch.ones(64, dtype=torch.int64, device=seen.device) << torch.arange(64, device=seen.device)
    return (bits * weights).sum(-1)  # bit 63 wraps to the sign bit, as intended


def empty_trees(batch: int, budget: int, max_depth: int, device: torch.device | str) -> DraftTrees:
    """Uninitialized DraftTrees buffers of the given sizes (e.g. static buffers for CUDA graphs)."""

    def empty(*shape: int) -> torch.Tensor:
        return torch.empty(shape, dtype=torch.int64, device=device)

    return DraftTrees(
        tokens=empty(batch, budget),
        parents=empty(batch, budget),
        depths=empty(batch, budget),
        num_nodes=empty(batch),
        visibility=empty(batch, budget + 1, visibility_words(budget)),
        max_depth=max_depth,
    )


def check_out_trees(out: DraftTrees, batch: int, budget: int, max_depth: int, device: torch.device) -> None:
    """`out` must hold contiguous int64 buffers of the sizes empty_trees would give, on `device`."""
    if out.max_depth != max_depth:
        raise ValueError(f"out.max_depth is {out.max_depth}, the draft has D = {max_depth}")
    want = {
        "tokens": (batch, budget),
        "parents": (batch, budget),
        "depths": (batch, budget),
        "num_nodes": (batch,),
        "visibility": (batch, budget + 1, visibility_words(budget)),
    }
    for name, shape in want.items():
        t = getattr(out, name)
        if tuple(t.shape) != shape or t.dtype != torch.int64 or t.device != device or not t.is_contiguous():
            raise ValueError(
                f"out.{name} must be a contiguous int64 tensor of shape {shape} on {device}, "
                f"got {t.dtype} {tuple(t.shape)} on {t.device}"
            )


def check_builder_inputs(top_logprobs: torch.Tensor, top_tokens: torch.Tensor, budget: int) -> None:
    """Shape / dtype / device checks that need no host synchronization."""
    if not isinstance(budget, int) or isinstance(budget, bool) or budget < 1:
        raise ValueError(f"budget must be an int >= 1, got {budget!r}")
    if top_logprobs.dim() != 3:
        raise ValueError(f"top_logprobs must be [B, D, K], got shape {tuple(top_logprobs.shape)}")
    if top_tokens.shape != top_logprobs.shape:
        raise ValueError(
            f"top_tokens shape {tuple(top_tokens.shape)} != top_logprobs shape {tuple(top_logprobs.shape)}"
        )
    if top_logprobs.dtype != torch.float32:
        raise TypeError(f"top_logprobs must be float32, got {top_logprobs.dtype}")
    if top_tokens.dtype != torch.int64:
        raise TypeError(f"top_tokens must be int64, got {top_tokens.dtype}")
    if top_logprobs.device != top_tokens.device:
        raise ValueError(f"top_logprobs on {top_logprobs.device} but top_tokens on {top_tokens.device}")
    _, depth, k = top_logprobs.shape
    if depth < 1 or k < 1:
        raise ValueError(f"top_logprobs needs D >= 1 and K >= 1, got D={depth}, K={k}")


def check_builder_values(top_logprobs: torch.Tensor, top_tokens: torch.Tensor, budget: int) -> None:
    """Value checks (they synchronize with the host): no NaN / +inf, ranks sorted descending."""
    lp = top_logprobs[..., : min(top_logprobs.shape[2], budget)]
    if torch.isnan(lp).any():
        raise ValueError("top_logprobs contains NaN")
    if torch.isposinf(lp).any():
        raise ValueError("top_logprobs contains +inf")
    if lp.shape[2] > 1:
        rising = lp[..., 1:] > lp[..., :-1]
        if rising.any():
            b, d, r = (int(i) for i in rising.nonzero()[0])
            raise ValueError(
                f"top_logprobs must be sorted descending along K: at batch {b}, depth {d}, "
                f"rank {r + 1} ({lp[b, d, r + 1].item()}) > rank {r} ({lp[b, d, r].item()})"
            )
    if (top_tokens[..., : lp.shape[2]] < 0).any():
        raise ValueError("top_tokens contains negative token ids")


def check_trees(trees: DraftTrees) -> None:
    """Consistency of a DraftTrees' shapes and dtypes."""
    b, budget = trees.tokens.shape
    for name in ("tokens", "parents", "depths"):
        t = getattr(trees, name)
        if t.shape != (b, budget) or t.dtype != torch.int64:
            raise ValueError(f"trees.{name} must be int64 [{b}, {budget}], got {t.dtype} {tuple(t.shape)}")
    if trees.num_nodes.shape != (b,) or trees.num_nodes.dtype != torch.int64:
        raise ValueError(f"trees.num_nodes must be int64 [{b}], got {trees.num_nodes.dtype} {tuple(trees.num_nodes.shape)}")
    if trees.max_depth < 1:
        raise ValueError(f"trees.max_depth must be >= 1, got {trees.max_depth}")


def check_posterior(trees: DraftTrees, posterior: torch.Tensor) -> None:
    """posterior must be integer [B, budget + 1] on the trees' device."""
    expected = (trees.batch_size, trees.budget + 1)
    if posterior.dim() != 2 or tuple(posterior.shape) != expected:
        raise ValueError(f"posterior must be [B, budget + 1] = {list(expected)}, got {tuple(posterior.shape)}")
    if posterior.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"posterior must hold int32 or int64 token ids, got {posterior.dtype}")
    if posterior.device != trees.tokens.device:
        raise ValueError(f"posterior on {posterior.device} but trees on {trees.tokens.device}")
