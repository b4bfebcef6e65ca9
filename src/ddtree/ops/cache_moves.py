"""A round's commit of cache entries (engine/commit.py): every layer's accepted tree rows moved to
consecutive slots, the reference and one Triton launch for all layers.

    move_entries_reference  PyTorch: per layer, gather every moved entry, then scatter them
    _move_kernel            one program per (layer, request, column block): the request's moves
                            one after another, each a load and a store

One program may take a request's moves in order without a copy because a path's rows only grow:
the entry moved to slot prefix + k comes from slot prefix + r_k with r_k >= k and r_1 < r_2 < ...,
so no move reads a slot an earlier move of its request wrote. Requests own their pages; moves
that carry nothing (steps past a request's accepted length, inactive requests) read and write the
scratch page, whose contents are never read. The layers' caches must be views of one tensor
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
def _move_kernel(cache_ptr, src_ptr, dst_ptr, layer_stride, width, moves,
                 BLOCK_W: tl.constexpr, PDL: tl.constexpr):
    wait_for_producers(PDL)
    layer = tl.program_id(0).to(tl.int64)
    request = tl.program_id(1)
    cols = tl.program_id(2) * BLOCK_W + tl.arange(0, BLOCK_W)
    ok = cols < width
    base = cache_ptr + layer * layer_stride
    for d in range(moves):  # in order: see the module's docstring
        src = tl.load(src_ptr + request * moves + d)
        dst = tl.load(dst_ptr + request * moves + d)
        entry = tl.load(base + src * width + cols, mask=ok)
        tl.store(base + dst * width + cols, entry, mask=ok)


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


def move_entries(caches: list[torch.Tensor], src: torch.Tensor, dst: torch.Tensor, requests: int,
                 pdl: bool = True) -> None:
    """move_entries_reference's moves in one launch: caches [pages, page_size, W] per layer (views of
    one tensor: layer_stride); src, dst int64 [requests * D], request b's D moves at b * D .. in
    path order. Raises ValueError when the caches are not one tensor's views or the moves' shapes
    disagree."""
    require_kernel_device(caches[0].device, "move_entries")
    stride = layer_stride(caches)
    if stride is None:
        raise ValueError("move_entries: the caches must be equal, contiguous views of one tensor at a fixed stride")
    if src.shape != dst.shape or src.dim() != 1 or requests <= 0 or src.numel() % requests:
        raise ValueError(f"move_entries: src and dst must be [requests * D] for requests={requests}, got "
                         f"{list(src.shape)} and {list(dst.shape)}")
    if src.dtype != torch.int64 or dst.dtype != torch.int64 or not src.is_contiguous() or not dst.is_contiguous():
        raise ValueError(f"move_entries: src and dst must be contiguous int64, got {src.dtype} and {dst.dtype}")
    moves, width = src.numel() // requests, caches[0].shape[-1]
    if moves == 0:
        return
    block_w = min(256, triton.next_power_of_2(width))  # several programs per layer and request at B = 1
    _move_kernel[(len(caches), requests, triton.cdiv(width, block_w))](
        caches[0], src, dst, stride, width, moves, BLOCK_W=block_w, num_warps=4, **launch_flags(src.device, pdl))
