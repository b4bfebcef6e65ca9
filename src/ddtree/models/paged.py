"""A forward over the paged latent cache: its metadata, the cache's reads and writes, attention.

One forward writes its N new tokens' cache entries at slots prefix_len .. prefix_len + N - 1 of
each request, then attends. Two forms, told apart by the metadata:

- ForwardMeta, the verify / decode form: absorbed MLA; each row attends to the committed prefix
  plus the new rows its visibility bitmask marks (a causal chain for decode, ancestors for a
  draft tree); the tree-verify kernel (ddtree.attention) or its PyTorch reference.
- PrefillMeta, the prefill form of a prompt chunk: the request's entries for slots
  0 .. prefix + n - 1 are gathered back from its pages, MLA expands them with kv_b_proj into
  per-head keys and values, and SDPA runs with a causal mask offset by the prefix. With many rows
  per request, expanding each key once is cheaper than the absorbed form's latent-width products
  per head and row. Not done here (what a varlen flash kernel would bring): requests are padded
  to the longest prefix + N keys and masked densely when their prefixes differ, and the whole
  expanded prefix is materialized at once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from torch.nn.attention.bias import CausalBias, causal_lower_right

from ..attention import tree_verify_mla
from ..ops.gemm import MAX_ROWS, skinny_matmul
from ..ops.mla import absorbed_query, rotary_into, write_latent_entries
from ..ops.policy import KernelPolicy


@dataclass
class ForwardMeta:
    """Per-forward metadata (shapes fixed by B and N, so a forward can be graph-captured).

    block_table:  int32 [B, max_pages]  pages of each request (-1 = none); must cover prefix_len + num_rows.
    prefix_lens:  int32 [B]             committed tokens already in the cache.
    num_rows:     int32 [B]             valid new rows per request (<= N), the root included for a
                                        tree (1 + DraftTrees.num_nodes); the rest is padding.
    positions:    int64 [B, N]          rotary positions of the new rows.
    visibility:   int64 [B, N, ceil(N / 64)]  bitmask: new row n sees new row j (DraftTrees layout).
    slot_mapping: int64 [B, N]          flat cache slot (page * page_size + offset) each new row's
                                        entry goes to; padding rows go to the cache's scratch page.

    Build it with ForwardMeta.build, which derives slot_mapping from the other fields once per
    forward (not once per layer).
    """

    block_table: torch.Tensor
    prefix_lens: torch.Tensor
    num_rows: torch.Tensor
    positions: torch.Tensor
    visibility: torch.Tensor
    slot_mapping: torch.Tensor

    @classmethod
    def build(cls, block_table, prefix_lens, num_rows, positions, visibility, *, page_size: int, scratch_page: int) -> "ForwardMeta":
        """The metadata of one forward; scratch_page is the cache page that absorbs padding rows
        (Target.new_cache puts it last). Tensors as in the class docstring; no host sync."""
        rows = positions.shape[1]
        return cls(block_table, prefix_lens, num_rows, positions, visibility,
                   slot_mapping(block_table, prefix_lens, num_rows, rows, page_size, scratch_page))


def slot_mapping(block_table: torch.Tensor, prefix_lens: torch.Tensor, num_rows: torch.Tensor, rows: int,
                 page_size: int, scratch_page: int) -> torch.Tensor:
    """int64 [B, rows]: flat cache slot of new row n of each request (slot prefix_len + n);
    padding rows (n >= num_rows) go to the scratch page."""
    n = torch.arange(rows, device=prefix_lens.device).expand(prefix_lens.shape[0], rows)
    return cache_slots(block_table, prefix_lens, n, n < num_rows.long()[:, None], page_size, scratch_page)


def cache_slots(block_table: torch.Tensor, prefix_lens: torch.Tensor, offsets: torch.Tensor, valid: torch.Tensor,
                page_size: int, scratch_page: int) -> torch.Tensor:
    """int64 [B, R]: flat slot (page * page_size + offset) of slot prefix_lens + offsets [B, R].

    Entries where valid [B, R] is False, and any whose page is not in the block table (-1, or past
    its end), point into the scratch page instead (offset r % page_size): such a write must never
    land in a page another request owns (a -1 read as an index would pick the last page). The
    engine reserves pages before a round, so valid rows always have one.
    """
    slots = prefix_lens.long()[:, None] + offsets.long()
    page_index = slots // page_size
    in_table = (page_index < block_table.shape[1]) & (slots >= 0)
    pages = block_table.long().gather(1, page_index.clamp(0, block_table.shape[1] - 1))
    keep = valid & in_table & (pages >= 0)
    r = torch.arange(offsets.shape[1], device=offsets.device)
    return torch.where(keep, pages * page_size + slots % page_size, scratch_page * page_size + r % page_size)


def to_device(values, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host list (or CPU tensor) as a tensor on `device`, queued behind the work already there.
    On CUDA it goes through page-locked memory: a copy from pageable memory waits for the stream,
    so a prefill that built its inputs that way waited for the round in flight and then for its
    own kernels, once per input."""
    host = values.to(dtype) if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
    if torch.device(device).type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


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
        prefix = to_device(prefix_lens, torch.int32, device)
        valid = to_device(num_rows, torch.int32, device)
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

    @classmethod
    def from_start(cls, block_table: torch.Tensor, num_rows: torch.Tensor, rows: int, *, page_size: int,
                   scratch_page: int) -> "PrefillMeta":
        """A chunk at position 0 of every request, from device values alone (a CUDA graph captures
        it): block_table int32 [B, max_pages], num_rows int32 [B] (each <= rows). Every key is
        masked by key_written (the same work whatever the lengths); L = N, so SDPA's is_causal."""
        batch, device = num_rows.shape[0], num_rows.device
        prefix = torch.zeros_like(num_rows)
        positions = torch.arange(rows, device=device).repeat(batch, 1)  # [B, N]: row n at position n
        written = positions < num_rows.long()[:, None]
        key_slots = cache_slots(block_table, prefix, positions, written, page_size, scratch_page)
        return cls(prefix, num_rows, positions, slot_mapping(block_table, prefix, num_rows, rows, page_size, scratch_page),
                   key_slots, written, None)


def gather_entries(cache: torch.Tensor, meta: PrefillMeta) -> torch.Tensor:
    """cache [num_pages, page_size, D] -> entries [B, L, D] of slots 0 .. L - 1 of each request,
    zero past prefix + num_rows."""
    entries = cache.view(-1, cache.shape[-1])[meta.key_slots]
    if meta.key_written is not None:
        entries = entries.masked_fill(~meta.key_written[..., None], 0.0)
    return entries


def write_entries(cache: torch.Tensor, entries: torch.Tensor, meta) -> None:
    """cache [num_pages, page_size, D] <- entries [B, N, D] at meta.slot_mapping (padding rows
    land in the scratch page, never in a request's pages). meta: a ForwardMeta or a PrefillMeta,
    which map their rows the same way."""
    width = cache.shape[-1]
    cache.view(-1, width)[meta.slot_mapping.flatten()] = entries.reshape(-1, width).to(cache.dtype)


def attend_reference(q: torch.Tensor, cache: torch.Tensor, meta: ForwardMeta, scale: float, latent_dim: int) -> torch.Tensor:
    """PyTorch path (CPU, float32 / float64): q [B, N, H, D] -> latent output [B, N, H, latent_dim].

    Gathers each request's prefix_len + N entries and masks with a dense [B, N, L] boolean.
    On the CPU L is the longest prefix + N (read back to the host); on CUDA it is the block
    table's whole span, so that no value is read back and a CUDA graph can capture it (a float32
    engine on a GPU). Padding rows (>= num_rows) come back as zeros.
    """
    b, n, _, _ = q.shape
    page_size = cache.shape[1]
    length = meta.block_table.shape[1] * page_size if q.is_cuda else int(meta.prefix_lens.max()) + n
    slots = torch.arange(length, device=q.device)
    pages = meta.block_table.long()[:, (slots // page_size).clamp_max(meta.block_table.shape[1] - 1)]
    keys = cache[pages, slots % page_size].to(q.dtype)  # [B, L, D]
    # Slots past a request's prefix + valid rows are never seen; they may hold stale or NaN
    # entries, and 0 x NaN would still poison the weighted sum below.
    written = slots[None, :] < (meta.prefix_lens.long() + meta.num_rows.long())[:, None]
    keys = keys.masked_fill(~written[..., None], 0.0)
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


def attend(q: torch.Tensor, cache: torch.Tensor, meta: ForwardMeta, scale: float, latent_dim: int,
           policy: KernelPolicy | None = None) -> torch.Tensor:
    """Tree-verify attention: with a policy that takes kernels here (on CUDA, or interpreted on the
    CPU where the policy says so), the tree-verify kernel where it runs (bf16 / fp16, a 512-wide
    latent), else (and with no policy) the PyTorch reference."""
    if (policy is not None and policy.kernel("attention", q) and q.dtype in (torch.bfloat16, torch.float16)
            and latent_dim == 512):
        out, _ = tree_verify_mla(q.contiguous(), cache, meta.block_table, meta.prefix_lens, meta.num_rows,
                                 meta.visibility, scale, check=False, pdl=policy.pdl)
        return out
    return attend_reference(q, cache, meta, scale, latent_dim)


def absorbed_attention(q: torch.Tensor, kv: torch.Tensor, w_kv_b: torch.Tensor, latent_norm: tuple[torch.Tensor, float],
                       meta: ForwardMeta, cache: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], scale: float,
                       interleave: bool, policy: KernelPolicy) -> torch.Tensor:
    """The kernel path of MLA.forward_paged from its projections to o_proj's input (policy: its
    PDL and the few-row GEMM's limit).

    q:           [B, N, H, nope + rope] (MLA.project; strided views are fine), kv [B, N, C + rope].
    w_kv_b:      kv_b_proj's weight as [H, nope + v, C].
    latent_norm: (weight [C], eps) of kv_a_layernorm.
    rope:        (cos, sin) [B, N, rope / 2] in q's dtype.
    Returns [B * N, H, v]. The entries go to the cache in one kernel (norm, rotary, cast, write);
    the two absorbed products are batched GEMMs over heads that write into their consumers'
    layouts (the query's latent slice, o_proj's row-major input) instead of being copied there.
    At most policy.gemm_max_rows rows (a decode step) run the few-row GEMM kernel, and the query's
    GEMM, its rotary part and the cache entries share one launch (ops/mla.absorbed_query).
    """
    b, n, heads, qk = q.shape
    latent = w_kv_b.shape[2]
    rope_dim = kv.shape[-1] - latent
    nope = qk - rope_dim
    rows = b * n
    cos, sin = (t.reshape(rows, -1) for t in rope)
    entries = (kv.reshape(rows, -1), latent_norm[0], latent_norm[1], cos, sin, cache.view(-1, cache.shape[-1]),
               meta.slot_mapping.view(-1))
    q = q.reshape(rows, heads, qk)
    pdl = policy.pdl
    if rows <= min(policy.gemm_max_rows, MAX_ROWS):  # a decode step: the three launches below as one
        query = absorbed_query(q, w_kv_b[:, :nope], *entries, interleave, pdl=pdl)
        bmm = lambda a, b, out: skinny_matmul(a, b, out, pdl=pdl)  # noqa: E731
    else:
        write_latent_entries(*entries, interleave, pdl=pdl)
        query = torch.empty(rows, heads, latent + rope_dim, dtype=q.dtype, device=q.device)
        torch.bmm(q[..., :nope].transpose(0, 1), w_kv_b[:, :nope], out=query[..., :latent].transpose(0, 1))  # W_UK
        rotary_into(q[..., nope:], cos, sin, query[..., latent:], interleave, pdl=pdl)
        bmm = torch.bmm
    query = query.view(b, n, heads, -1)
    w_uv = w_kv_b[:, nope:].transpose(1, 2)  # [H, C, v]
    out_latent = attend(query, cache, meta, scale, latent, policy)  # [B, N, H, C]
    out = torch.empty(rows, heads, w_kv_b.shape[1] - nope, dtype=q.dtype, device=q.device)
    bmm(out_latent.view(rows, heads, latent).transpose(0, 1).to(q.dtype), w_uv, out=out.transpose(0, 1))  # W_UV
    return out
