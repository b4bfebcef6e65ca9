"""A round's commit of cache entries (engine/commit.py): every layer's accepted tree rows moved to
consecutive slots, the reference and one Triton launch for all layers.

    move_entries_reference  PyTorch: per layer, gather every moved entry (flat slots from
                            engine/commit.commit_slots), then scatter them
    _commit_kernel          one program per (layer, request, column block): the request's moves
                            one after another, each slot looked up in its block table, a load and a
                            store (no slot tensors: nothing launches before it)

One program may take a request's moves in order without a copy because a path's rows only grow:
the entry moved to slot prefix + k comes from slot prefix + r_k with r_k >= k and r_1 < r_2 < ...,
so no move reads a slot an earlier move of its request wrote. Requests own their pages; moves
that carry nothing (steps past a request's accepted length, inactive requests) are skipped by the
kernel (the reference sends them through the scratch page, whose contents are never read), as are
moves whose page is not in the block table. The layers' caches must be views of one tensor
(models/target.py's new_cache makes them so), which a single launch addresses by layer stride.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import launch_flags, require_kernel_device, wait_for_producers


def move_entries_reference(caches: list[torch.Tensor], src: torch.Tensor, dst: torch.Tensor) -> None:
    """In every layer's cache [pages, page_size, W]: gather the entries at flat slots src, then
    scatter them to dst (int64 [M] each)."""
    for cache in caches:
        flat = cache.view(-1, cache.shape[-1])
        moved = flat[src]  # a copy: the scatter below cannot clobber a source
        flat[dst] = moved


@triton.jit
def _commit_kernel(cache_ptr, table_ptr, prefix_ptr, accepted_ptr, accept_len_ptr, active_ptr,
                   layer_stride, width, depth, table_width, page_size, stride_table, stride_accepted,
                   BLOCK_W: tl.constexpr, PDL: tl.constexpr):
    wait_for_producers(PDL)
    layer = tl.program_id(0).to(tl.int64)
    request = tl.program_id(1).to(tl.int64)
    cols = tl.program_id(2) * BLOCK_W + tl.arange(0, BLOCK_W)
    ok = cols < width
    base = cache_ptr + layer * layer_stride
    table = table_ptr + request * stride_table
    prefix = tl.load(prefix_ptr + request).to(tl.int64)
    steps = tl.where(tl.load(active_ptr + request) != 0, tl.load(accept_len_ptr + request), 0)
    for d in range(1, depth + 1):  # in order: see the module's docstring
        if d < steps:
            src = prefix + tl.load(accepted_ptr + request * stride_accepted + d)
            dst = prefix + d
            src_page = tl.load(table + src // page_size, mask=(src >= 0) & (src // page_size < table_width),
                               other=-1).to(tl.int64)
            dst_page = tl.load(table + dst // page_size, mask=dst // page_size < table_width, other=-1).to(tl.int64)
            if (src_page >= 0) & (dst_page >= 0):
                entry = tl.load(base + (src_page * page_size + src % page_size) * width + cols, mask=ok)
                tl.store(base + (dst_page * page_size + dst % page_size) * width + cols, entry, mask=ok)


def layer_stride(caches: list[torch.Tensor]) -> int | None:
    """Elements from one layer's cache to the next's when the caches are equal, contiguous views of
    one tensor at a fixed stride (one launch can address them all); None otherwise."""
    first = caches[0]
    if len(caches) == 1:
        return first.numel() if first.is_contiguous() else None
    stride = caches[1].data_ptr() - first.data_ptr()
    if stride < first.numel() * first.element_size() or stride % first.element_size():
        return None  # overlapping layers would race
    for i, cache in enumerate(caches):
        if (cache.shape != first.shape or cache.dtype != first.dtype or not cache.is_contiguous()
                or cache.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()
                or cache.data_ptr() != first.data_ptr() + i * stride):
            return None
    return stride // first.element_size()


def commit_moves(caches: list[torch.Tensor], block_table: torch.Tensor, prefix_lens: torch.Tensor,
                 accepted: torch.Tensor, accept_len: torch.Tensor, active: torch.Tensor, pdl: bool = True) -> None:
    """The commit's moves (engine/commit.commit_slots' through move_entries_reference) in one launch.

    caches: [pages, page_size, W] per layer, views of one tensor (layer_stride).
    block_table int32 [B, P], prefix_lens int32 [B], accepted int64 [B, D + 1] (row indices from
    the root, -1 after), accept_len int64 [B], active bool [B]: request b's path step k (1 <= k <
    accept_len[b], when active) moves the entry of slot prefix + accepted[b, k] to slot prefix + k.
    Raises ValueError when the caches are not one tensor's views or the inputs' shapes disagree.
    """
    require_kernel_device(caches[0].device, "commit_moves")
    stride = layer_stride(caches)
    if stride is None:
        raise ValueError("commit_moves: the caches must be equal, contiguous views of one tensor at a fixed stride")
    batch = accepted.shape[0]
    wanted = {"block_table": (block_table, torch.int32, 2), "prefix_lens": (prefix_lens, torch.int32, 1),
              "accepted": (accepted, torch.int64, 2), "accept_len": (accept_len, torch.int64, 1),
              "active": (active, torch.bool, 1)}
    for name, (t, dtype, dims) in wanted.items():
        if t.dtype != dtype or t.dim() != dims or t.shape[0] != batch or t.stride(-1) != 1 or t.device != caches[0].device:
            raise ValueError(f"commit_moves: {name} must be {dtype} with {dims} dims, {batch} rows, unit last stride, on "
                             f"{caches[0].device}; got {t.dtype} {list(t.shape)} on {t.device}")
    depth, width = accepted.shape[1] - 1, caches[0].shape[-1]
    if batch == 0 or depth == 0:
        return
    block_w = min(256, triton.next_power_of_2(width))  # several programs per layer and request at B = 1
    _commit_kernel[(len(caches), batch, triton.cdiv(width, block_w))](
        caches[0], block_table, prefix_lens, accepted, accept_len, active, stride, width, depth, block_table.shape[1],
        caches[0].shape[1], block_table.stride(0), accepted.stride(0), BLOCK_W=block_w, num_warps=4,
        **launch_flags(accepted.device, pdl))
