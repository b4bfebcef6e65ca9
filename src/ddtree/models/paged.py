"""Absorbed MLA over the paged latent cache: the verify / decode form of attention.

One forward writes its N new tokens' cache entries at slots prefix_len .. prefix_len + N - 1 of
each request and attends, per row, to the committed prefix plus the new rows its visibility
bitmask marks (a causal chain for prefill and decode, ancestors for a draft tree).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..attention import tree_verify_mla


@dataclass
class ForwardMeta:
    """Per-forward metadata (shapes fixed by B and N, so a forward can be graph-captured).

    block_table: int32 [B, max_pages]  pages of each request; must cover prefix_len + N slots.
    prefix_lens: int32 [B]             committed tokens already in the cache.
    num_rows:    int32 [B]             valid new rows per request (<= N); the rest is padding.
    positions:   int64 [B, N]          rotary positions of the new rows.
    visibility:  int64 [B, N, ceil(N / 64)]  bitmask: new row n sees new row j (DraftTrees layout).
    """

    block_table: torch.Tensor
    prefix_lens: torch.Tensor
    num_rows: torch.Tensor
    positions: torch.Tensor
    visibility: torch.Tensor


def cache_slots(meta: ForwardMeta, page_size: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(page, offset) int64 [B, N] of the new rows' cache slots."""
    slots = meta.prefix_lens.long()[:, None] + torch.arange(rows, device=meta.prefix_lens.device)
    pages = meta.block_table.long().gather(1, slots // page_size)
    return pages, slots % page_size


def write_entries(cache: torch.Tensor, entries: torch.Tensor, meta: ForwardMeta) -> None:
    """cache [num_pages, page_size, D] <- entries [B, N, D] at the new rows' slots."""
    pages, offsets = cache_slots(meta, cache.shape[1], entries.shape[1])
    cache[pages, offsets] = entries.to(cache.dtype)


def attend_reference(q: torch.Tensor, cache: torch.Tensor, meta: ForwardMeta, scale: float, latent_dim: int) -> torch.Tensor:
    """PyTorch path (CPU, float32 / float64): q [B, N, H, D] -> latent output [B, N, H, latent_dim].

    Gathers each request's prefix_len + N entries and masks with a dense [B, N, L] boolean; reads
    the longest prefix back to the host, so unlike the CUDA kernel it is not graph-capturable.
    Padding rows (>= num_rows) come back as zeros.
    """
    b, n, _, _ = q.shape
    page_size = cache.shape[1]
    length = int(meta.prefix_lens.max()) + n
    slots = torch.arange(length, device=q.device)
    pages = meta.block_table.long()[:, (slots // page_size).clamp_max(meta.block_table.shape[1] - 1)]
    keys = cache[pages, slots % page_size].to(q.dtype)  # [B, L, D]
    prefix = meta.prefix_lens.long()[:, None, None]
    j = slots[None, None, :] - prefix  # new-row index of each key, negative in the prefix
    word = meta.visibility.gather(2, (j.clamp(0, n - 1) // 64).expand(b, n, length))
    tree_bit = ((word >> (j.clamp(0, n - 1) % 64)) & 1).bool()
    valid_row = torch.arange(n, device=q.device)[None, :, None] < meta.num_rows.long()[:, None, None]
    seen = valid_row & ((j < 0) | ((j < n) & tree_bit))
    scores = torch.einsum("bnhd,bld->bhnl", q, keys) * scale
    scores = scores.masked_fill(~seen[:, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # padding rows may see nothing
    return torch.einsum("bhnl,bld->bnhd", probs, keys[..., :latent_dim])


def attend(q: torch.Tensor, cache: torch.Tensor, meta: ForwardMeta, scale: float, latent_dim: int) -> torch.Tensor:
    """Tree-verify attention: the Triton kernel on CUDA for bf16 / fp16, else the PyTorch path."""
    if q.is_cuda and q.dtype in (torch.bfloat16, torch.float16) and latent_dim == 512:
        out, _ = tree_verify_mla(
            q.contiguous(), cache, meta.block_table, meta.prefix_lens, meta.num_rows, meta.visibility, scale, check=False
        )
        return out
    return attend_reference(q, cache, meta, scale, latent_dim)
