"""Float64 reference of tree-verify MLA attention (absorbed form): the readable specification.

Row (b, n, h) is tree node n of request b seen by head h. Its keys are the request's committed
prefix (slots 0 .. prefix_len - 1) and the tree slots prefix_len + j of every node j that the
visibility bitmask marks as n itself or an ancestor. Each cache entry is 576 values: a 512-dim
latent (also the value) and a 64-dim rotary key, shared by all heads.
"""

from __future__ import annotations

import torch


def gather_tokens(kv_cache: torch.Tensor, block_table: torch.Tensor, b: int, length: int) -> torch.Tensor:
    """Request b's first `length` cache entries, [length, 576], in slot order."""
    page_size = kv_cache.shape[1]
    slots = torch.arange(length, device=kv_cache.device)
    pages = block_table[b, slots // page_size].long()
    return kv_cache[pages, slots % page_size]


def visible_tree_slots(visibility: torch.Tensor, b: int, n: int, num_rows: int) -> torch.Tensor:
    """Bool [num_rows]: which tree nodes node n of request b sees (bit j of word j // 64)."""
    j = torch.arange(num_rows, device=visibility.device)
    words = visibility[b, n, j // 64]
    return ((words >> (j % 64)) & 1).bool()


def tree_verify_mla_reference(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    prefix_lens: torch.Tensor,
    num_rows: torch.Tensor,
    visibility: torch.Tensor,
    softmax_scale: float,
    value_dim: int = 512,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as ddtree.attention.tree_verify_mla, computed in float64.

    Returns out float64 [B, N, H, value_dim] (zeros on padding rows) and lse float64 [B, N, H]
    (natural log of the softmax denominator of the scaled scores; -inf on padding rows).
    """
    batch, rows, heads, _ = q.shape
    out = torch.zeros(batch, rows, heads, value_dim, dtype=torch.float64, device=q.device)
    lse = torch.full((batch, rows, heads), float("-inf"), dtype=torch.float64, device=q.device)
    for b in range(batch):
        prefix = int(prefix_lens[b])
        kv = gather_tokens(kv_cache, block_table, b, prefix + rows).double()
        for n in range(int(num_rows[b])):
            seen = torch.cat([torch.ones(prefix, dtype=torch.bool, device=q.device),
                              visible_tree_slots(visibility, b, n, rows)])
            keys = kv[seen]  # [keys, 576]
            scores = (q[b, n].double() @ keys.T) * softmax_scale  # [H, keys]
            lse[b, n] = torch.logsumexp(scores, dim=-1)
            out[b, n] = torch.softmax(scores, dim=-1) @ keys[:, :value_dim]
    return out, lse
