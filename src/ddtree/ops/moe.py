"""Routed (and shared) SwiGLU experts for few rows (decode, tree verify) as Triton kernels: each
expert's weights read once per block of its rows, only for the experts the tokens chose.

    align_by_expert      (token, choice) pairs grouped by expert, padded to blocks of BLOCK_M
    gate_up_kernel      h[p] = silu(x[t] @ Wg[e]) * (x[t] @ Wu[e]) per pair p = (t, choice), e = ids[p];
                         shared expert s of token t: row P + s * T + t, its own weights
    down_kernel         y[p] = weights[p] * (h[p] @ Wd[e]), float32; shared rows with weight 1
    sum_choices_kernel  out[t] = y[t, 0] + ... + y[t, k-1] + y[P + t] + ... + y[P + (S-1) * T + t],
                         in that order (no atomics)

Up to `direct_max_tokens` tokens (a decode step: KernelPolicy.moe_direct_max_tokens) the launch
skips the alignment: one routed program per choice, its expert read from ids, since a token's
choices are distinct experts. `moe_grouped.grouped_moe` is the reference: the same sum through two
grouped GEMMs (torch._grouped_mm), also the path for many rows and for autograd.

The shared experts (DeepSeek-V3's n_shared_experts, one MLP of S x the routed width) ride in the
same launches as S more experts that every token takes with weight 1, read in place from the
MLP's weights (moe_kernels.py): at a decode token that saves the MLP's own GEMMs, its silu,
mul and the add, and reads its weights at the fused kernels' bandwidth.

The intermediate h is stored in x's dtype, as the grouped-GEMM path rounds it; the GEMMs and the
sum accumulate in float32. Every launch has a grid fixed by the shapes: CUDA-graph capturable.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from . import moe_int4
from .int4 import PackedInt4
from .launch import DTYPES, dot_flags, launch_flags, require_kernel_device
from .moe_kernels import down_kernel, gate_up_kernel, sum_choices_kernel
from .moe_align import ExpertBlocks, align_by_expert, max_blocks
from .moe_grouped import expert_shape

# Tiles from a sweep (benchmarks/moe_paths.py, results/moe_paths-nvidia-h200.md): the wide tile
# wherever the gate_up launch has about a program per SM, the narrow one below (tiles_for).
# BLOCK_M follows the rows each expert gets (block_m_for): 16, tl.dot's minimum, while a block would
# be mostly padding.
BLOCK_M = 16
BLOCK_N = 128
BLOCK_K = 64
NARROW_TILES = (64, 128)  # (BLOCK_N, BLOCK_K) when the gate_up launch would leave SMs idle
MIN_PROGRAMS = 128
NUM_WARPS = 4
NUM_STAGES = 3
SUM_BLOCK = 1024  # hidden columns per program of the sum over choices


def block_m_for(num_pairs: int, num_experts: int, row_kernels: bool = False) -> int:
    """Rows per expert block: the mean pairs per expert rounded up to a power of two, in [16, 64]
    for tl.dot's tiles; with row_kernels (INT4 experts that take them: moe_int4.int4_row_kernels)
    up to INT4_ROWS_MAX that power of two itself (the row kernels take blocks of any power of two)."""
    rows = triton.next_power_of_2(max(1, -(-num_pairs // num_experts)))
    return rows if row_kernels and rows <= moe_int4.INT4_ROWS_MAX else min(64, max(BLOCK_M, rows))


def tiles_for(num_pairs: int, inter: int) -> tuple[int, int]:
    """(block_n, block_k): the wide tile unless its gate_up launch has under MIN_PROGRAMS programs."""
    return (BLOCK_N, BLOCK_K) if num_pairs * triton.cdiv(inter, BLOCK_N) >= MIN_PROGRAMS else NARROW_TILES


@dataclass
class Workspace:
    """The buffers fused_moe fills before its output (P = T * k routed pairs, S shared experts);
    pass one to keep them static or, in tests, to poison them."""

    sorted_pairs: torch.Tensor  # int32 [max_blocks * block_m], see moe_align
    block_expert: torch.Tensor  # int32 [max_blocks]
    h: torch.Tensor  # x.dtype [P + S * T, inter]: silu(gate) * up per routed pair, then per (shared, token)
    y: torch.Tensor  # float32 [P + S * T, hidden]: weighted expert output, rows as h
    # float32 [P, 2 * inter] for the INT4 row kernels (block_m < 16; [0, 2 * inter] otherwise): their
    # gate and up per routed pair (their h rows stay unused)
    gu: torch.Tensor

    @classmethod
    def empty(cls, num_tokens: int, top_k: int, num_experts: int, hidden: int, inter: int,
              dtype: torch.dtype, device: torch.device | str, block_m: int | None = None,
              num_shared: int = 0, row_kernels: bool = False) -> Workspace:
        """row_kernels: for INT4 experts that take the row kernels at few rows (block_m_for)."""
        pairs = num_tokens * top_k
        block_m = block_m_for(pairs, num_experts, row_kernels) if block_m is None else block_m
        blocks = max_blocks(pairs, num_experts, block_m)
        rows = pairs + num_shared * num_tokens
        return cls(torch.empty(blocks * block_m, dtype=torch.int32, device=device),
                   torch.empty(blocks, dtype=torch.int32, device=device),
                   torch.empty(rows, inter, dtype=dtype, device=device),
                   torch.empty(rows, hidden, dtype=torch.float32, device=device),
                   torch.empty(pairs if block_m < 16 else 0, 2 * inter, dtype=torch.float32, device=device))


@dataclass
class SharedExperts:
    """The shared MLP's nn.Linear weights, read in place: gate and up x.dtype [S * inter, hidden],
    down x.dtype [hidden, S * inter], each contiguous (gate and up may be views of one buffer, as
    joint.join leaves them). S = the rows of gate / the routed experts' inter."""

    gate: torch.Tensor
    up: torch.Tensor
    down: torch.Tensor

    def count(self, hidden: int, inter: int) -> int:
        """S, after checking the shapes against the routed experts' (hidden, inter)."""
        width = self.gate.shape[0] if self.gate.dim() == 2 else -1
        if width <= 0 or width % inter:
            raise ValueError(f"shared.gate must be [S * inter, hidden] with inter={inter}, got {list(self.gate.shape)}")
        for name, shape in (("gate", (width, hidden)), ("up", (width, hidden)), ("down", (hidden, width))):
            if tuple(getattr(self, name).shape) != shape:
                raise ValueError(f"shared.{name} must be {list(shape)}, got {list(getattr(self, name).shape)}")
        return width // inter


def _check(x, w_gate_up, w_down, weights, ids, shared: SharedExperts | None) -> int:
    """Raises on a bad input; returns the number of shared experts."""
    if x.dim() != 2:
        raise ValueError(f"x must be [T, hidden], got shape {list(x.shape)}")
    if x.dtype not in DTYPES:
        raise TypeError(f"x must be one of {DTYPES}, got {x.dtype}")
    if x.stride(-1) != 1:
        raise ValueError(f"x must be contiguous in its last dimension, got strides {x.stride()}")
    tokens, hidden = x.shape
    checks = [("weights", weights, torch.float32, ids.shape), ("ids", ids, torch.int64, None)]
    if isinstance(w_gate_up, PackedInt4):
        experts, inter = moe_int4.check_int4(x, w_gate_up, w_down, weights, ids)
    else:
        if isinstance(w_down, PackedInt4):
            raise TypeError("w_gate_up and w_down must both be INT4 (PackedInt4) or both tensors")
        if w_gate_up.dim() != 3 or w_gate_up.shape[1] != hidden or w_gate_up.shape[2] % 2:
            raise ValueError(f"w_gate_up must be [E, hidden={hidden}, 2 * inter], got {list(w_gate_up.shape)}")
        experts, inter = w_gate_up.shape[0], w_gate_up.shape[2] // 2
        if tuple(w_down.shape) != (experts, inter, hidden):
            raise ValueError(f"w_down must be [E, inter, hidden] = {[experts, inter, hidden]} to match "
                             f"w_gate_up {list(w_gate_up.shape)} and x, got {list(w_down.shape)}")
        checks += [("w_gate_up", w_gate_up, x.dtype, None), ("w_down", w_down, x.dtype, None)]
    if ids.dim() != 2 or ids.shape[0] != tokens:
        raise ValueError(f"ids must be [T={tokens}, k], got {list(ids.shape)}")
    num_shared = 0
    if shared is not None:
        num_shared = shared.count(hidden, inter)
        checks += [(f"shared.{n}", getattr(shared, n), x.dtype, None) for n in ("gate", "up", "down")]
    for name, t, dtype, shape in checks:
        if t.dtype != dtype:
            raise TypeError(f"{name} must be {dtype}{' (x.dtype)' if dtype is x.dtype else ''}, got {t.dtype}")
        if shape is not None and t.shape != shape:
            raise ValueError(f"{name} must have the shape of ids {list(shape)}, got {list(t.shape)}")
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous, got strides {t.stride()} for shape {list(t.shape)}")
        if t.device != x.device:
            raise ValueError(f"{name} is on {t.device} but x is on {x.device}")
    require_kernel_device(x.device, "fused_moe")
    return num_shared


def fused_moe(
    x: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    *,
    shared: SharedExperts | None = None,
    out: torch.Tensor | None = None,
    workspace: Workspace | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
    block_k: int | None = None,
    direct_max_tokens: int = 1,
    pdl: bool = True,
) -> torch.Tensor:
    """SwiGLU experts: out[t] = sum_j weights[t, j] * expert_{ids[t, j]}(x[t]) (+ shared MLP(x[t])).

    x:          [T, hidden], bf16 / fp16 / fp32, contiguous in its last dimension.
    w_gate_up:  x.dtype [E, hidden, 2 * inter], contiguous: per expert [gate | up], transposed
                (MoE.w_gate_up); or INT4 (ops/int4.PackedInt4) [E, 2 * inter, hidden]: gate rows,
                then up rows, as compressed-tensors packs them or in the interleaved order (its
                own tiles, INT4_INTERLEAVED_TILES; bf16 only) (then w_down too).
    w_down:     x.dtype [E, inter, hidden], contiguous (MoE.w_down); or INT4 [E, hidden, inter].
    weights:    float32 [T, k], contiguous: the router's weight of each choice.
    ids:        int64 [T, k], contiguous: the chosen experts; a pair whose id is outside [0, E) (-1:
                another rank's expert under expert parallelism) is dropped and adds nothing.
    shared:     optional SharedExperts (MoE.shared_experts' weights, S * inter wide), added with
                weight 1 inside the same launches.
    out:        optional x.dtype [T, hidden] contiguous buffer for the result.
    workspace:  optional Workspace.empty(T, k, E, hidden, inter, x.dtype, x.device, block_m, S).
    block_m, block_n, block_k: tile sizes (powers of two >= 16), for tuning and tests; None:
                block_m_for(T * k, E) and tiles_for(T * k + S * T, inter) (moe_int4.INT4_TILES for INT4 experts,
                INT4_INTERLEAVED_TILES for interleaved ones).
                INT4 experts also take a block_m below 16 (a power of two): the row kernels
                (moe_int4_rows.py; None chooses them up to INT4_ROWS_MAX pairs per expert where
                moe_int4.int4_row_kernels says, with INT4_ROWS_TILES), whose sums are not the dequantized
                twin's to the bit.
    direct_max_tokens: up to this many tokens, no alignment (above); 0: always aligned.
    pdl:        programmatic dependent launch where the GPU has it (ops/launch.py).
    Returns out: x.dtype [T, hidden]; expert outputs (routed in choice order, then shared) are
    summed in float32, then cast once.
    """
    num_shared = _check(x, w_gate_up, w_down, weights, ids, shared)
    (tokens, hidden), top_k = x.shape, ids.shape[1]
    experts, _, inter = expert_shape(w_gate_up)
    int4 = isinstance(w_gate_up, PackedInt4)
    row_kernels = int4 and moe_int4.int4_row_kernels(x, w_gate_up, w_down)
    if block_m is None:
        block_m = block_m_for(ids.numel(), experts, row_kernels)
    if block_m < 16 and not int4:
        raise ValueError(f"block_m must be a power of two >= 16 (tl.dot), got {block_m}: below 16 (the row "
                         "kernels) takes INT4 experts only")
    if int4:
        wide_n, wide_k = moe_int4.int4_tiles(w_gate_up, block_m)
    else:
        wide_n, wide_k = tiles_for(ids.numel() + num_shared * tokens, inter)
    block_n = wide_n if block_n is None else block_n
    block_k = wide_k if block_k is None else block_k
    rows = block_m < 16  # the row kernels (INT4): any power of two of rows and output columns
    for name, size, least in (("block_m", block_m, 1 if int4 else 16), ("block_n", block_n, 1 if rows else 16),
                              ("block_k", block_k, 16)):
        if size < least or size & (size - 1):
            raise ValueError(f"{name} must be a power of two >= {least}, got {size}")
    if out is None:
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
    if (out.shape != x.shape or out.dtype != x.dtype or out.device != x.device
                            or not out.is_contiguous()):
        raise ValueError(f"out must be a contiguous {x.dtype} [{tokens}, {hidden}] on {x.device}, "
                         f"got {out.dtype} {list(out.shape)} on {out.device}")
    if workspace is None:
        workspace = Workspace.empty(tokens, top_k, experts, hidden, inter, x.dtype, x.device, block_m, num_shared)
    else:
        want = Workspace.empty(tokens, top_k, experts, hidden, inter, x.dtype, "meta", block_m, num_shared)
        for name in ("sorted_pairs", "block_expert", "h", "y", "gu"):
            got, need = getattr(workspace, name), getattr(want, name)
            if got.shape != need.shape or got.dtype != need.dtype or got.device != x.device or not got.is_contiguous():
                raise ValueError(f"workspace.{name} must be a contiguous {need.dtype} {list(need.shape)} on "
                                 f"{x.device}, got {got.dtype} {list(got.shape)} on {got.device}")
    if tokens == 0 or (top_k == 0 and num_shared == 0):  # no expert: zeros
        return out.zero_()
    blocks = None  # direct: pair p's program reads its expert from ids itself
    if tokens > direct_max_tokens:
        blocks = align_by_expert(ids, experts, block_m, out=(workspace.sorted_pairs, workspace.block_expert), pdl=pdl)
    _launch(x, w_gate_up, w_down, weights, ids, blocks, workspace, shared, num_shared, block_m, block_n, block_k, pdl)
    sum_choices_kernel[(tokens, triton.cdiv(hidden, SUM_BLOCK))](
        workspace.y, ids, out, hidden, tokens * top_k, tokens, experts, TOP_K=top_k, SHARED=num_shared,
        BLOCK=SUM_BLOCK, num_warps=NUM_WARPS, **launch_flags(x.device, pdl))
    return out


def _launch(x, w_gate_up, w_down, weights, ids, blocks: ExpertBlocks | None, ws: Workspace, shared,
            num_shared, block_m, block_n, block_k, pdl) -> None:
    """The two GEMMs' launches, into ws.y; blocks None: direct mode, one routed program per pair,
    experts from ids."""
    routed_blocks = ids.numel() if blocks is None else blocks.block_expert.numel()
    block_expert = ids if blocks is None else blocks.block_expert
    if block_m >= 16:
        _launch_dot(x, w_gate_up, w_down, weights, block_expert, ws, shared, num_shared, routed_blocks, block_m,
                    block_n, block_k, pdl, direct=blocks is None)
        return
    # INT4 experts through the row kernels; the shared experts in tl.dot launches of their own, so
    # that the row kernels' programs hold no tl.dot tiles (registers, shared memory)
    moe_int4.launch_rows(x, w_gate_up, w_down, weights, blocks, block_expert, ws, routed_blocks, block_m, block_n,
                         block_k, NUM_STAGES, pdl)
    if num_shared:
        shared_tiles = tiles_for(num_shared * x.shape[0], ws.h.shape[1])
        _launch_dot(x, x, x, weights, None, ws, shared, num_shared, 0, moe_int4.SHARED_M, *shared_tiles, pdl)


def _launch_dot(x, w_gate_up, w_down, weights, block_expert, ws: Workspace, shared, num_shared, routed_blocks,
                block_m, block_n, block_k, pdl, direct=False) -> None:
    """moe_kernels' two tl.dot kernels: routed_blocks routed programs (none: the shared experts alone,
    with x standing in for the routed weights), then num_shared * token blocks shared ones."""
    tokens, hidden = x.shape
    inter = ws.h.shape[1]
    experts, top_k, num_pairs = (expert_shape(w_gate_up)[0] if routed_blocks else 0), weights.shape[1], weights.numel()
    token_blocks = triton.cdiv(tokens, block_m)
    programs = routed_blocks + num_shared * token_blocks  # shared programs follow the routed blocks
    int4 = isinstance(w_gate_up, PackedInt4)
    # per weight: (the routed weight, its scale, stride per expert, per row, and the scale's two)
    up_w, down_w = ((w.packed, w.scale, *w.packed.stride()[:2], *w.scale.stride()[:2]) if int4
                    else (w, w, *w.stride()[:2], 0, 0) for w in (w_gate_up, w_down))
    # without shared experts their branch never runs, but it compiles: a stand-in of the activations' dtype
    gate, up, down = (shared.gate, shared.up, shared.down) if shared is not None else (x,) * 3
    block_expert = ws.block_expert if block_expert is None else block_expert
    unpack = moe_int4.int4_unpack(x, w_gate_up, w_down) if int4 else "word"
    flags = dict(**dot_flags(x.dtype), DIRECT=direct, W4=int4, GROUP=w_gate_up.group_size if int4 else 32,
                 EVEN_K=int4 and hidden % block_k == 0 and inter % block_k == 0, UNPACK=unpack,
                 SCALE_PAIRS=int4 and moe_int4.scale_pairs(unpack, w_gate_up, w_down, block_k),
                 STEP=moe_int4.INT4_INTERLEAVED_STEP if unpack.startswith("interleaved") else 256,
                 **launch_flags(x.device, pdl))
    many_interleaved = int4 and w_gate_up.interleaved and block_m >= 64
    stages = moe_int4.INT4_INTERLEAVED_STAGES_MANY if many_interleaved else NUM_STAGES
    tiles = dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=NUM_WARPS, num_stages=stages)
    gate_up_kernel[(programs, triton.cdiv(inter, block_n))](
        x, up_w[0], ws.sorted_pairs, block_expert, ws.h, gate, up, up_w[1],
        num_pairs, experts, tokens, top_k, hidden, inter, routed_blocks, token_blocks,
        x.stride(0), up_w[2], up_w[3], ws.h.stride(0), gate.stride(0), up_w[4], up_w[5],
        **tiles, **flags,
    )
    down_kernel[(programs, triton.cdiv(hidden, block_n))](
        ws.h, down_w[0], weights, ws.sorted_pairs, block_expert, ws.y, down, down_w[1],
        num_pairs, experts, tokens, inter, hidden, routed_blocks, token_blocks,
        ws.h.stride(0), down_w[2], down_w[3], ws.y.stride(0), down.stride(0), down_w[4], down_w[5],
        **tiles, **flags,
    )
