"""The commit of a round: accepted tree rows' cache entries move to consecutive slots.

Node i of a tree was verified at cache slot prefix + i, at rotary position prefix + depth(i). The
accepted path's k-th node (depth k) belongs at slot prefix + k, where its position already puts
it. Sources and destinations overlap (node 3 may move to slot 2 while node 2 moves to 1): PyTorch's
path gathers all moved entries of a layer before scattering any; the kernel (ops/cache_moves.py)
takes each request's moves in path order, which never reads a slot already written, and finds
the slots itself.
"""

from __future__ import annotations

import torch

from ..models.paged import cache_slots
from ..ops import cache_moves
from ..ops.policy import KernelPolicy


def commit_slots(block_table: torch.Tensor, prefix_lens: torch.Tensor, accepted: torch.Tensor, accept_len: torch.Tensor,
                 active: torch.Tensor, page_size: int, scratch_page: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat source and destination slots int64 [B * D] of the moves (path steps 1 .. D; the root,
    step 0, is already in place). Steps past accept_len, and inactive requests, read and write
    the scratch page.

    block_table int32 [B, P], prefix_lens int32 [B], accepted int64 [B, D + 1] (row indices from
    the root, -1 after), accept_len int64 [B], active bool [B].
    """
    steps = torch.arange(1, accepted.shape[1], device=accepted.device).expand(accepted.shape[0], -1)
    move = active[:, None] & (steps < accept_len[:, None])
    src = cache_slots(block_table, prefix_lens, accepted[:, 1:].clamp_min(0), move, page_size, scratch_page)
    dst = cache_slots(block_table, prefix_lens, steps, move, page_size, scratch_page)
    return src.flatten(), dst.flatten()


def commit(caches: list[torch.Tensor], block_table: torch.Tensor, prefix_lens: torch.Tensor, accepted: torch.Tensor,
           accept_len: torch.Tensor, active: torch.Tensor, page_size: int, scratch_page: int,
           policy: KernelPolicy) -> None:
    """Move every layer's accepted entries (commit_slots' arguments; caches [pages, page_size, W]):
    one launch for all layers, slots looked up inside it, where the policy takes kernels and the
    caches are one tensor's views (ops/cache_moves.py); else commit_slots and per layer in PyTorch."""
    if policy.kernel("commit", accepted) and cache_moves.layer_stride(caches) is not None:
        cache_moves.commit_moves(caches, block_table, prefix_lens, accepted, accept_len, active, policy.pdl)
    else:
        src, dst = commit_slots(block_table, prefix_lens, accepted, accept_len, active, page_size, scratch_page)
        cache_moves.move_entries_reference(caches, src, dst)


def commit_reference(caches: list[torch.Tensor], block_table: torch.Tensor, prefix_lens: torch.Tensor,
                     accepted: torch.Tensor, accept_len: torch.Tensor, active: torch.Tensor) -> None:
    """The same commit, one request and one entry at a time (the readable specification)."""
    page_size = caches[0].shape[1]
    for b in range(accepted.shape[0]):
        if not bool(active[b]):
            continue
        prefix, n = int(prefix_lens[b]), int(accept_len[b])
        path = [int(r) for r in accepted[b, :n]]

        def at(slot: int) -> tuple[int, int]:
            return int(block_table[b, slot // page_size]), slot % page_size

        for cache in caches:
            entries = [cache[at(prefix + row)].clone() for row in path]
            for k, entry in enumerate(entries):
                cache[at(prefix + k)] = entry
