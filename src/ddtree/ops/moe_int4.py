"""INT4 routed experts in fused_moe (ops/moe.py): their checks, which path and unpacking they take,
and the row kernels' launch. Two paths: moe_kernels' tl.dot tiles (W4, unpacked as INT4_UNPACK says:
int4_tiles.py) at any rows, or, where those cannot unpack in pairs, moe_int4_rows' row kernels at up
to INT4_ROWS_MAX pairs per expert."""

from __future__ import annotations

import torch
import triton

from .int4 import PackedInt4, interleave_fits
from .launch import TL_DTYPES, compiled_for_sm90, launch_flags
from .moe_grouped import expert_shape
from .moe_int4_rows import down_rows_kernel, gate_up_rows_kernel

# INT4 experts: the narrowest tile of a sweep at 1 and 9 rows (results/moe_paths-kimi-k2.6-int4-tiles-*):
# their programs unpack words rather than wait on memory, so more of them must run at once.
INT4_TILES = (32, 128)
# INT4 experts at up to INT4_ROWS_MAX pairs per expert (mean, a power of two), where the tl.dot path
# cannot unpack in pairs (int4_row_kernels): the row kernels (moe_int4_rows.py), in blocks of that
# many pairs, with tiles (BLOCK_N, BLOCK_K) INT4_ROWS_TILES
# (results/moe_paths-kimi-k2.6-int4-rows-*: 1 x 16 x 256 and 2 x 16 x 256 with 2 warps ran fastest at 1, 9
# and 65 rows; dev/int4_gemv_variants: 256 columns and 2 warps ran a one-row GEMV fastest).
INT4_ROWS_MAX = 4
INT4_ROWS_TILES = (16, 256)
INT4_ROWS_WARPS = 2
# How the tl.dot path unpacks INT4 tiles: "word" or "pairs" (int4_tiles.py; int4_unpack
# says what runs). Pairs ran faster than word at 544 rows on an H100, and than the row kernels at
# 1 to 65 (results/moe_paths-kimi-k2.6-int4-pairs-nvidia-h100.md, -unpack-).
INT4_UNPACK = "pairs"
# Experts in the group-interleaved order (int4.interleave_int4) take their own tiles
# (int4_interleaved.py): BLOCK_N output rows (the tensor cores' 64-row side) in whole 256-column blocks; the
# K tile is the shared experts' (their 16-bit tiles ride in the same launch).
INT4_INTERLEAVED_TILES = (64, 64)
# Their pipeline stages at block_m >= 64 (a tree verify's thousands of rows): 2 ran 1.44x faster than
# 3 at 2080 rows (results/moe_paths-kimi-k2.6-int4-interleaved-2080-nvidia-h100.md); fewer rows keep NUM_STAGES.
INT4_INTERLEAVED_STAGES_MANY = 2
# Columns an interleaved tile's K step multiplies: 256 (a whole interleaved block) or 128 (half of
# one: half the unpacked operand live a step, for more CTAs an SM at many rows; docs/notes/int4.md).
INT4_INTERLEAVED_STEP = 256
# Whether the pairs tiles load their group scales two to an int32 word where they can (scale_pairs):
# False loads one per word, a load the pipeliner cannot copy ahead (int4_tiles.py).
INT4_SCALE_PAIRS = True
SHARED_M = 16  # tokens per shared-expert program beside the row kernels (tl.dot's minimum)


def check_int4(x, w_gate_up: PackedInt4, w_down, weights, ids) -> tuple[int, int]:
    """INT4 experts' checks; returns (E, inter)."""
    if not isinstance(w_down, PackedInt4):
        raise TypeError("w_gate_up and w_down must both be INT4 (PackedInt4) or both tensors")
    if w_gate_up.group_size != w_down.group_size:
        raise ValueError(f"w_gate_up and w_down group sizes differ: {w_gate_up.group_size} and {w_down.group_size}")
    experts, hidden, inter = expert_shape(w_gate_up)
    if hidden != x.shape[1] or w_gate_up.out_features % 2:
        raise ValueError(f"w_gate_up must hold [E, 2 * inter, hidden={x.shape[1]}] INT4 weights, got packed "
                         f"{list(w_gate_up.packed.shape)}")
    w_gate_up.check("w_gate_up", (experts,), 2 * inter, hidden, x.device)
    w_down.check("w_down", (experts,), hidden, inter, x.device)
    if w_gate_up.interleaved != w_down.interleaved:
        raise ValueError("w_gate_up and w_down must both be interleaved (int4.interleave_int4) or neither")
    if w_gate_up.interleaved and not x.dtype == w_gate_up.scale.dtype == w_down.scale.dtype == torch.bfloat16:
        raise ValueError(f"interleaved INT4 experts need bf16 activations and scales, got {x.dtype} activations, "
                         f"{w_gate_up.scale.dtype} and {w_down.scale.dtype} scales")
    if w_gate_up.interleaved and (w_gate_up.scale.data_ptr() % 4 or w_down.scale.data_ptr() % 4):
        raise ValueError("interleaved INT4 experts' scales must start 4-byte aligned (they load as int32 pairs)")
    return experts, inter


def int4_row_kernels(x: torch.Tensor, w_gate_up: PackedInt4, w_down: PackedInt4) -> bool:
    """Whether these INT4 experts take the row kernels at few pairs per expert: only where the
    tl.dot path cannot unpack in pairs natively, which ran faster at 1 to 65 rows
    (results/moe_paths-kimi-k2.6-int4-pairs-nvidia-h100.md); never for interleaved weights (the row
    kernels read compressed-tensors' order)."""
    return int4_unpack(x, w_gate_up, w_down) not in ("pairs", "interleaved", "interleaved_plain")


def int4_unpack(x: torch.Tensor, w_gate_up: PackedInt4, w_down: PackedInt4) -> str:
    """INT4_UNPACK where it can run: "pairs" needs bf16 activations and scales ("word" otherwise),
    and its inline PTX sm_90 ("pairs_plain", the same tile in plain Triton, otherwise). Interleaved
    weights: "interleaved" ("interleaved_plain" off sm_90)."""
    if w_gate_up.interleaved:  # their own order, their own tiles (bf16: check_int4)
        return "interleaved" if compiled_for_sm90(x.device) else "interleaved_plain"
    if INT4_UNPACK not in ("word", "pairs"):
        raise ValueError(f"INT4_UNPACK must be 'word' or 'pairs', got {INT4_UNPACK!r}")
    if INT4_UNPACK != "pairs":
        return INT4_UNPACK
    if not x.dtype == w_gate_up.scale.dtype == w_down.scale.dtype == torch.bfloat16:
        return "word"
    return "pairs" if compiled_for_sm90(x.device) else "pairs_plain"


def int4_tiles(w_gate_up: PackedInt4, block_m: int) -> tuple[int, int]:
    """The default (block_n, block_k) of INT4 experts at block_m rows: the interleaved order's own
    tiles (tl.dot only), the row kernels' below 16 rows, else INT4_TILES."""
    if w_gate_up.interleaved:
        if block_m < 16:
            raise ValueError(f"interleaved INT4 experts take tl.dot tiles only: block_m must be >= 16, got {block_m}")
        return INT4_INTERLEAVED_TILES
    return INT4_ROWS_TILES if block_m < 16 else INT4_TILES


def interleavable(w_gate_up: PackedInt4, w_down: PackedInt4, device: torch.device) -> bool:
    """Whether experts stored on `device` can take the interleaved order and tiles with the inline
    PTX (int4_interleaved.py): sm_90 or later, bf16 scales, group size 32, both depths positive
    multiples of 256."""
    return compiled_for_sm90(device) and all(
        w.scale.dtype == torch.bfloat16 and interleave_fits(w.group_size, w.in_features) for w in (w_gate_up, w_down))


def scale_pairs(unpack: str, w_gate_up: PackedInt4, w_down: PackedInt4, block_k: int) -> bool:
    """Whether the tl.dot tiles (unpacked as `unpack`) load their scales as int32 words of two groups
    (int4_tiles._scale_pairs): INT4_SCALE_PAIRS, bf16 scales unpacked in pairs, the group size
    dividing block_k at least twice, an even number of groups per row and 4-byte aligned scales."""
    group = w_gate_up.group_size
    return (INT4_SCALE_PAIRS and unpack in ("pairs", "pairs_plain") and block_k % (2 * group) == 0
            and all(w.scale.dtype == torch.bfloat16 and w.scale.shape[-1] % 2 == 0 and w.scale.data_ptr() % 4 == 0
                    for w in (w_gate_up, w_down)))


def launch_rows(x, w_gate_up: PackedInt4, w_down: PackedInt4, weights, blocks, block_expert, ws, routed_blocks,
                block_m, block_n, block_k, num_stages: int, pdl: bool) -> None:
    """moe_int4_rows' two kernels over the routed pairs: gate and up into ws.gu, then ws.y (a
    moe.Workspace)."""
    hidden = x.shape[1]
    experts, _, inter = expert_shape(w_gate_up)
    top_k, num_pairs = weights.shape[1], weights.numel()
    flags = dict(DIRECT=blocks is None, GROUP=w_gate_up.group_size, BLOCK_N=block_n, BLOCK_K=block_k, ROWS=block_m,
                 num_warps=INT4_ROWS_WARPS, num_stages=num_stages, **launch_flags(x.device, pdl))
    gu, down = w_gate_up, w_down  # short names for the long argument lists below
    gate_up_rows_kernel[(routed_blocks, triton.cdiv(2 * inter, block_n))](
        x, gu.packed, ws.sorted_pairs, block_expert, ws.gu, gu.scale, num_pairs, experts, top_k, hidden, 2 * inter,
        x.stride(0), gu.packed.stride(0), gu.packed.stride(1), ws.gu.stride(0), gu.scale.stride(0), gu.scale.stride(1),
        EVEN_K=hidden % block_k == 0, **flags,
    )
    down_rows_kernel[(routed_blocks, triton.cdiv(hidden, block_n))](
        ws.gu, down.packed, weights, ws.sorted_pairs, block_expert, ws.y, down.scale, num_pairs, experts, inter, hidden,
        ws.gu.stride(0), down.packed.stride(0), down.packed.stride(1), ws.y.stride(0), down.scale.stride(0),
        down.scale.stride(1), EVEN_K=inter % block_k == 0, DTYPE=TL_DTYPES[x.dtype], **flags,
    )
