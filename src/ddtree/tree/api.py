"""Public entry points of the draft-tree stage: build_trees and accept_paths, with backend choice."""

from __future__ import annotations

import torch

from ..ops.launch import require_kernel_device
from .reference import accept_paths_reference, build_trees_reference
from .types import (
    MAX_TRITON_BUDGET,
    MAX_TRITON_DEPTH,
    TREE_FIELDS,
    DraftTrees,
    check_builder_inputs,
    check_builder_values,
    check_out_trees,
    check_posterior,
    check_trees,
)

BACKENDS = ("auto", "reference", "triton")


def _resolve_backend(backend: str, device: torch.device) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        return "triton" if device.type == "cuda" else "reference"
    if backend == "triton":
        require_kernel_device(device, "backend='triton'")
    return backend


def build_trees(
    top_logprobs: torch.Tensor,
    top_tokens: torch.Tensor,
    budget: int,
    *,
    backend: str = "auto",
    check: bool = False,
    out: DraftTrees | None = None,
) -> DraftTrees:
    """Select each request's `budget` most likely draft continuations as a tree.

    top_logprobs: float32 [B, D, K], each row sorted descending (topk_logprobs' output).
    top_tokens:   int64   [B, D, K], the matching token ids.
    budget:       nodes per tree (root excluded), >= 1; the first min(K, budget) ranks are used.
    backend:      "reference" (heapq, the specification), "triton" (one batched launch), or
                  "auto" (triton for CUDA tensors, reference otherwise).
    check:        also validate values (no NaN / +inf, sorted ranks); this syncs with the host.
                  The reference backend always does.
    out:          optional DraftTrees buffers (empty_trees) to write into, e.g. a CUDA graph's
                  static outputs; returned.
    Returns DraftTrees (types.py). Both backends return identical trees for identical inputs.
    """
    check_builder_inputs(top_logprobs, top_tokens, budget)
    batch, depth, _ = top_logprobs.shape
    if out is not None:
        check_out_trees(out, batch, budget, depth, top_logprobs.device)
    backend = _resolve_backend(backend, top_logprobs.device)
    if check or backend == "reference":
        check_builder_values(top_logprobs, top_tokens, budget)
    if backend == "reference":
        trees = build_trees_reference(top_logprobs, top_tokens, budget)
        if out is None:
            return trees
        for name in TREE_FIELDS:
            getattr(out, name).copy_(getattr(trees, name))
        return out
    if budget > MAX_TRITON_BUDGET or depth > MAX_TRITON_DEPTH:
        raise ValueError(
            f"the triton builder supports budget <= {MAX_TRITON_BUDGET} and D <= {MAX_TRITON_DEPTH}, "
            f"got budget={budget}, D={depth}; use backend='reference'"
        )
    from .build_triton import build_trees_triton

    return build_trees_triton(top_logprobs, top_tokens, budget, out=out)


def accept_paths(
    trees: DraftTrees, posterior: torch.Tensor, *, backend: str = "auto"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Walk each tree along the target's own choices.

    trees:     DraftTrees from build_trees.
    posterior: int32/int64 [B, budget + 1], the target's chosen token after each node
               (column 0 = root, column i = node i).
    Returns accepted int64 [B, D + 1] (accepted node indices from the root, -1 after),
    accept_len int64 [B] (root included) and bonus int64 [B] (the target's token at the last
    accepted node: the next round's root).
    """
    check_trees(trees)
    check_posterior(trees, posterior)
    backend = _resolve_backend(backend, posterior.device)
    if backend == "reference":
        return accept_paths_reference(trees, posterior)
    from .accept_triton import accept_paths_triton

    return accept_paths_triton(trees, posterior)
