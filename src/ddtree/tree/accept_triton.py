"""Batched accept walk in Triton: one program per request, no host synchronization."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .types import PAD, DraftTrees

_PAD: tl.constexpr = tl.constexpr(PAD)


@triton.jit
def _accept_kernel(
    tokens_ptr, parents_ptr, num_nodes_ptr, post_ptr,
    out_accepted, out_len, out_bonus,
    stride_tb, stride_tn, stride_pb, stride_pn, stride_post_b, stride_post_n,
    budget, depth_max,
    CAP: tl.constexpr, CAP1: tl.constexpr, D_PAD: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, CAP)
    n = tl.load(num_nodes_ptr + b)
    valid = (offs < n) & (offs < budget)  # a corrupt num_nodes > budget must not read past the row
    tok = tl.load(tokens_ptr + b * stride_tb + offs * stride_tn, mask=valid, other=_PAD)
    par = tl.load(parents_ptr + b * stride_pb + offs * stride_pn, mask=valid, other=_PAD)
    node_ids = (offs + 1).to(tl.int64)
    offs1 = tl.arange(0, CAP1)
    post = tl.load(post_ptr + b * stride_post_b + offs1 * stride_post_n, mask=offs1 <= budget, other=0).to(tl.int64)

    path_ids = tl.arange(0, D_PAD)
    path = tl.where(path_ids == 0, 0, _PAD).to(tl.int64)
    cur = tl.zeros([], tl.int64)
    length = tl.full([], 1, tl.int64)
    walking = tl.full([], 1, tl.int1)
    for step in range(depth_max):
        target = tl.sum(tl.where(offs1 == cur, post, 0))
        match = valid & (par == cur) & (tok == target)
        child = tl.min(tl.where(match, node_ids, CAP + 1))  # lowest-numbered match
        walking = walking & (child <= CAP)
        cur = tl.where(walking, child, cur)
        path = tl.where(path_ids == tl.where(walking, step + 1, -1), child, path)
        length += walking.to(tl.int64)
    tl.store(out_accepted + b * (depth_max + 1) + path_ids, path, mask=path_ids <= depth_max)
    tl.store(out_len + b, length)
    tl.store(out_bonus + b, tl.sum(tl.where(offs1 == cur, post, 0)))


def accept_paths_triton(trees: DraftTrees, posterior: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Triton accept walk; same contract as reference.accept_paths_reference (inputs validated)."""
    b, budget = trees.tokens.shape
    depth_max = trees.max_depth
    device = trees.tokens.device
    accepted = torch.empty((b, depth_max + 1), dtype=torch.int64, device=device)
    accept_len = torch.empty((b,), dtype=torch.int64, device=device)
    bonus = torch.empty((b,), dtype=torch.int64, device=device)
    if b > 0:
        _accept_kernel[(b,)](
            trees.tokens, trees.parents, trees.num_nodes, posterior,
            accepted, accept_len, bonus,
            *trees.tokens.stride(), *trees.parents.stride(), *posterior.stride(),
            budget, depth_max,
            CAP=triton.next_power_of_2(budget),
            CAP1=triton.next_power_of_2(budget + 1),
            D_PAD=triton.next_power_of_2(depth_max + 1),
            num_warps=max(1, min(8, budget // 128)),
        )
    return accepted, accept_len, bonus
