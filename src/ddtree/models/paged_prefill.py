"""Non-absorbed causal MLA over the paged cache: the prefill form of attention.

A prompt chunk writes its rows' cache entries exactly as a verify does (models/paged.py: the same
slot mapping, padding rows into the scratch page), then gathers each request's entries for slots
0 .. prefix + n - 1 back from its pages. MLA expands them with kv_b_proj into per-head keys and
values and runs SDPA with a causal mask offset by the prefix: row i, at position prefix + i, sees
keys 0 .. prefix + i. It is the form serving engines prefill with: with many rows per request,
expanding each key once is cheaper than the absorbed form's latent-width (kv_lora_rank + rope)
products per head and row (the reasoning; nothing here is timed).

Not done here (what a varlen flash kernel would bring): requests are padded to the longest prefix
+ N keys, and masked by a dense [B, N, L] boolean when their prefixes differ, so padding rows and
keys are computed and thrown away; a varlen kernel (packed rows, cumulative lengths, bottom-right
causal) skips them. And the whole expanded prefix (B x L x heads x (nope + v) per layer) is
materialized at once, where serving engines attend to it in bounded pieces merged by log-sum-exp.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.nn.attention.bias import CausalBias, causal_lower_right

from .paged import cache_slots, slot_mapping


@dataclass
class PrefillMeta:
    """Per-forward metadata of a prefill chunk (B requests, N rows, L = max(prefix_lens) + N keys).

    prefix_lens:  int32 [B]     entries already in the cache from earlier chunks.
    num_rows:     int32 [B]     valid new rows per request (<= N); the rest is padding.
    positions:    int64 [B, N]  prefix + n: rotary positions of the new rows.
    slot_mapping: int64 [B, N]  as ForwardMeta's: new row n goes to slot prefix + n, padding rows
                                to the scratch page.
    key_slots:    int64 [B, L]  flat cache slot of key l = 0 .. L - 1 of each request (keys past
                                prefix + num_rows point into the scratch page).
    key_written:  bool [B, L] or None: key l < prefix + num_rows; the others are zeroed after the
                  gather (they may hold NaN or another chunk's garbage, and 0 x NaN is NaN even
                  under a mask). None when every key is written.
    attn_mask:    row n sees key l <= prefix + n, as
                  None: SDPA's is_causal, when every prefix is 0 (L = N);
                  a lower-right CausalBias, when all requests share one prefix (every chunk of
                  engine/prefill.py): no dense mask, so CUDA runs a flash / efficient kernel;
                  else bool [B, 1, N, L].
                  Padding rows see their causal range too (zeroed keys included): never a fully
                  masked row, whose softmax would be NaN.

    Build it with PrefillMeta.build from host values: prefill is host-driven (prompt lengths are
    host values), and the fast path is chosen without reading anything back from the device.
    """

    prefix_lens: torch.Tensor
    num_rows: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    key_slots: torch.Tensor
    key_written: torch.Tensor | None
    attn_mask: torch.Tensor | CausalBias | None

    @classmethod
    def build(cls, block_table: torch.Tensor, prefix_lens: list[int], num_rows: list[int], rows: int, *,
              page_size: int, scratch_page: int) -> "PrefillMeta":
        """block_table int32 [B, max_pages] on the device (must cover prefix + num_rows of each
        request); prefix_lens, num_rows: B host ints each; rows: N (>= max(num_rows)). The cache's
        scratch page as in ForwardMeta.build."""
        batch = len(prefix_lens)
        if len(num_rows) != batch or block_table.shape[0] != batch:
            raise ValueError(f"prefix_lens ({batch}), num_rows ({len(num_rows)}) and block_table "
                             f"({block_table.shape[0]}) must have one entry per request")
        if not all(0 <= n <= rows for n in num_rows) or min(prefix_lens, default=0) < 0:
            raise ValueError(f"need 0 <= num_rows <= rows={rows} and prefix_lens >= 0, got {num_rows}, {prefix_lens}")
        device = block_table.device
        prefix = torch.tensor(prefix_lens, dtype=torch.int32, device=device)
        valid = torch.tensor(num_rows, dtype=torch.int32, device=device)
        positions = prefix.long()[:, None] + torch.arange(rows, device=device)
        keys = max(prefix_lens, default=0) + rows
        key_index = torch.arange(keys, device=device).expand(batch, keys)
        written = key_index < (prefix.long() + valid.long())[:, None]
        key_slots = cache_slots(block_table, torch.zeros_like(prefix), key_index, written, page_size, scratch_page)
        if len(set(prefix_lens)) <= 1:  # one prefix: the causal mask is the same lower-right triangle for all
            mask = None if keys == rows else causal_lower_right(rows, keys)
        else:
            mask = (key_index[:, None, :] <= positions[:, :, None])[:, None]
        if all(p + n == keys for p, n in zip(prefix_lens, num_rows)):
            written = None
        return cls(prefix, valid, positions, slot_mapping(block_table, prefix, valid, rows, page_size, scratch_page),
                   key_slots, written, mask)


def gather_entries(cache: torch.Tensor, meta: PrefillMeta) -> torch.Tensor:
    """cache [num_pages, page_size, D] -> entries [B, L, D] of slots 0 .. L - 1 of each request,
    zero past prefix + num_rows."""
    entries = cache.view(-1, cache.shape[-1])[meta.key_slots]
    if meta.key_written is not None:
        entries = entries.masked_fill(~meta.key_written[..., None], 0.0)
    return entries
