"""Routed experts for few rows (decode, tree verify) as Triton kernels: each expert's weights read
once per block of its rows, only for the experts the tokens chose.

    align_by_expert      (token, choice) pairs grouped by expert, padded to blocks of BLOCK_M
    _gate_up_kernel      h[p] = silu(x[t] @ Wg[e]) * (x[t] @ Wu[e]) per pair p = (t, choice), e = ids[p]
    _down_kernel         y[p] = weights[p] * (h[p] @ Wd[e]), float32
    _sum_choices_kernel  out[t] = y[t, 0] + y[t, 1] + ... + y[t, k-1], in that order (no atomics)

The intermediate h is stored in x's dtype, as the grouped-GEMM path rounds it; the GEMMs and the
sum accumulate in float32. Every launch has a grid fixed by the shapes: CUDA-graph capturable.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton import knobs

from ..kernels import require_kernel_device
from .moe_align import ExpertBlocks, align_by_expert, max_blocks

# Tiles measured on the H200 (benchmarks/moe_paths.py, results/moe_paths-nvidia-h200.md), six
# shapes from 1 to 128 tokens at Moonlight's and Kimi K2's widths. 128 output columns x 64-deep K
# steps was fastest, or within 2% of it, wherever the gate_up launch has at least ~one program per
# SM; below that (a decode token: Moonlight 6 experts x 1408 / 128 = 66 programs) 64 x 128 was up to
# 18% faster (tiles_for). BLOCK_M follows the rows each expert gets (block_m_for): 16, tl.dot's
# minimum, while a block would be mostly padding.
BLOCK_M = 16
BLOCK_N = 128
BLOCK_K = 64
NARROW_TILES = (64, 128)  # (BLOCK_N, BLOCK_K) when the gate_up launch would leave SMs idle
MIN_PROGRAMS = 128
NUM_WARPS = 4
NUM_STAGES = 3
SUM_BLOCK = 1024  # hidden columns per program of the sum over choices
DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@triton.jit
def _dot(a, b, acc, DOT_F32: tl.constexpr, PRECISION: tl.constexpr):
    # DOT_F32: Triton 3.6's interpreter multiplies bf16 bit patterns as integers, so CPU runs upcast
    # bf16 (exactly) first. PRECISION "ieee" keeps float32 models off TF32, as torch.matmul is.
    if DOT_F32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision=PRECISION)
    return tl.dot(a, b, acc, input_precision=PRECISION)


@triton.jit
def _gate_up_kernel(
    x_ptr, w_ptr, sorted_pairs_ptr, block_expert_ptr, h_ptr,
    num_pairs, top_k, hidden, inter,
    stride_xt, stride_we, stride_wk, stride_hp,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_F32: tl.constexpr, PRECISION: tl.constexpr,
):
    pid_m = tl.program_id(0)  # fastest: the blocks of one expert share a weight tile in L2
    pid_n = tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m)
    if expert < 0:  # past the used blocks
        return
    pair = tl.load(sorted_pairs_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    row_ok = pair < num_pairs  # padding slots hold num_pairs
    token = (pair // top_k).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = offs_n < inter
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + token[:, None] * stride_xt + offs_k[None, :]
    w_ptrs = w_ptr + expert.to(tl.int64) * stride_we + offs_k[:, None] * stride_wk + offs_n[None, :]
    acc_gate = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        k_ok = offs_k < hidden - k0
        a = tl.load(x_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w_mask = k_ok[:, None] & col_ok[None, :]
        w_gate = tl.load(w_ptrs, mask=w_mask, other=0.0)
        w_up = tl.load(w_ptrs + inter, mask=w_mask, other=0.0)  # per expert [gate | up] columns
        acc_gate = _dot(a, w_gate, acc_gate, DOT_F32, PRECISION)
        acc_up = _dot(a, w_up, acc_up, DOT_F32, PRECISION)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K * stride_wk
    h = acc_gate * tl.sigmoid(acc_gate) * acc_up  # silu(gate) * up
    h_ptrs = h_ptr + pair.to(tl.int64)[:, None] * stride_hp + offs_n[None, :]
    tl.store(h_ptrs, h.to(h_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _down_kernel(
    h_ptr, w_ptr, weights_ptr, sorted_pairs_ptr, block_expert_ptr, y_ptr,
    num_pairs, inter, hidden,
    stride_hp, stride_we, stride_wk, stride_yp,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_F32: tl.constexpr, PRECISION: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m)
    if expert < 0:
        return
    pair = tl.load(sorted_pairs_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    row_ok = pair < num_pairs
    pair = tl.where(row_ok, pair, 0).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = offs_n < hidden
    offs_k = tl.arange(0, BLOCK_K)
    h_ptrs = h_ptr + pair[:, None] * stride_hp + offs_k[None, :]
    w_ptrs = w_ptr + expert.to(tl.int64) * stride_we + offs_k[:, None] * stride_wk + offs_n[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        k_ok = offs_k < inter - k0
        a = tl.load(h_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        acc = _dot(a, w, acc, DOT_F32, PRECISION)
        h_ptrs += BLOCK_K
        w_ptrs += BLOCK_K * stride_wk
    weight = tl.load(weights_ptr + pair, mask=row_ok, other=0.0)
    y_ptrs = y_ptr + pair[:, None] * stride_yp + offs_n[None, :]
    tl.store(y_ptrs, acc * weight[:, None], mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _sum_choices_kernel(y_ptr, out_ptr, hidden, TOP_K: tl.constexpr, BLOCK: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < hidden
    acc = tl.zeros([BLOCK], tl.float32)
    for j in tl.static_range(TOP_K):  # a fixed order: the same bits in every run and graph replay
        acc += tl.load(y_ptr + (token * TOP_K + j) * hidden + offs, mask=ok, other=0.0)
    tl.store(out_ptr + token * hidden + offs, acc.to(out_ptr.dtype.element_ty), mask=ok)


def block_m_for(num_pairs: int, num_experts: int) -> int:
    """Rows per expert block: the mean pairs per expert rounded up to a power of two, in [16, 64]."""
    return min(64, max(BLOCK_M, triton.next_power_of_2(max(1, -(-num_pairs // num_experts)))))


def tiles_for(num_pairs: int, inter: int) -> tuple[int, int]:
    """(block_n, block_k): the wide tile unless its gate_up launch has under MIN_PROGRAMS programs."""
    return (BLOCK_N, BLOCK_K) if num_pairs * triton.cdiv(inter, BLOCK_N) >= MIN_PROGRAMS else NARROW_TILES


@dataclass
class Workspace:
    """The buffers fused_moe fills before its output (P = T * k pairs); pass one to keep them
    static or, in tests, to poison them."""

    sorted_pairs: torch.Tensor  # int32 [max_blocks * block_m], see moe_align
    block_expert: torch.Tensor  # int32 [max_blocks]
    h: torch.Tensor  # x.dtype [P, inter]: silu(gate) * up per pair
    y: torch.Tensor  # float32 [P, hidden]: weighted expert output per pair

    @classmethod
    def empty(cls, num_tokens: int, top_k: int, num_experts: int, hidden: int, inter: int,
              dtype: torch.dtype, device: torch.device | str, block_m: int | None = None) -> Workspace:
        pairs = num_tokens * top_k
        block_m = block_m_for(pairs, num_experts) if block_m is None else block_m
        blocks = max_blocks(pairs, num_experts, block_m)
        return cls(torch.empty(blocks * block_m, dtype=torch.int32, device=device),
                   torch.empty(blocks, dtype=torch.int32, device=device),
                   torch.empty(pairs, inter, dtype=dtype, device=device),
                   torch.empty(pairs, hidden, dtype=torch.float32, device=device))


def _check(x, w_gate_up, w_down, weights, ids) -> None:
    if x.dim() != 2:
        raise ValueError(f"x must be [T, hidden], got shape {list(x.shape)}")
    if x.dtype not in DTYPES:
        raise TypeError(f"x must be one of {DTYPES}, got {x.dtype}")
    if x.stride(-1) != 1:
        raise ValueError(f"x must be contiguous in its last dimension, got strides {x.stride()}")
    tokens, hidden = x.shape
    if w_gate_up.dim() != 3 or w_gate_up.shape[1] != hidden or w_gate_up.shape[2] % 2:
        raise ValueError(f"w_gate_up must be [E, hidden={hidden}, 2 * inter], got {list(w_gate_up.shape)}")
    experts, inter = w_gate_up.shape[0], w_gate_up.shape[2] // 2
    if tuple(w_down.shape) != (experts, inter, hidden):
        raise ValueError(f"w_down must be [E, inter, hidden] = {[experts, inter, hidden]} to match "
                         f"w_gate_up {list(w_gate_up.shape)} and x, got {list(w_down.shape)}")
    if ids.dim() != 2 or ids.shape[0] != tokens:
        raise ValueError(f"ids must be [T={tokens}, k], got {list(ids.shape)}")
    for name, t, dtype, shape in (("w_gate_up", w_gate_up, x.dtype, None), ("w_down", w_down, x.dtype, None),
                                  ("weights", weights, torch.float32, ids.shape), ("ids", ids, torch.int64, None)):
        if t.dtype != dtype:
            raise TypeError(f"{name} must be {dtype}{' (x.dtype)' if name.startswith('w_') else ''}, got {t.dtype}")
        if shape is not None and t.shape != shape:
            raise ValueError(f"{name} must have the shape of ids {list(shape)}, got {list(t.shape)}")
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous, got strides {t.stride()} for shape {list(t.shape)}")
        if t.device != x.device:
            raise ValueError(f"{name} is on {t.device} but x is on {x.device}")
    require_kernel_device(x.device, "fused_moe")


def fused_moe(
    x: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    workspace: Workspace | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
    block_k: int | None = None,
) -> torch.Tensor:
    """Routed SwiGLU experts: out[t] = sum_j weights[t, j] * expert_{ids[t, j]}(x[t]).

    x:          [T, hidden], bf16 / fp16 / fp32, contiguous in its last dimension.
    w_gate_up:  x.dtype [E, hidden, 2 * inter], contiguous: per expert [gate | up], transposed
                (MoE.w_gate_up).
    w_down:     x.dtype [E, inter, hidden], contiguous (MoE.w_down).
    weights:    float32 [T, k], contiguous: the router's weight of each choice.
    ids:        int64 [T, k], contiguous: the chosen experts, each in [0, E) (not checked: that
                would read them back; a pair outside is dropped and its out row left undefined).
    out:        optional x.dtype [T, hidden] contiguous buffer for the result.
    workspace:  optional Workspace.empty(T, k, E, hidden, inter, x.dtype, x.device, block_m).
    block_m, block_n, block_k: tile sizes (powers of two >= 16), for tuning and tests; None:
                block_m_for(T * k, E) and tiles_for(T * k, inter).
    Returns out: x.dtype [T, hidden]; expert outputs are summed over the k choices in float32 in
    choice order, then cast once.
    """
    _check(x, w_gate_up, w_down, weights, ids)
    if block_m is None:
        block_m = block_m_for(ids.numel(), w_down.shape[0])
    wide_n, wide_k = tiles_for(ids.numel(), w_down.shape[1])
    block_n = wide_n if block_n is None else block_n
    block_k = wide_k if block_k is None else block_k
    for name, size in (("block_m", block_m), ("block_n", block_n), ("block_k", block_k)):
        if size < 16 or size & (size - 1):
            raise ValueError(f"{name} must be a power of two >= 16 (tl.dot), got {size}")
    (tokens, hidden), (experts, inter, _), top_k = x.shape, w_down.shape, ids.shape[1]
    if out is None:
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
    if out.shape != x.shape or out.dtype != x.dtype or out.device != x.device or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous {x.dtype} [{tokens}, {hidden}] on {x.device}, "
                         f"got {out.dtype} {list(out.shape)} on {out.device}")
    if workspace is None:
        workspace = Workspace.empty(tokens, top_k, experts, hidden, inter, x.dtype, x.device, block_m)
    else:
        want = Workspace.empty(tokens, top_k, experts, hidden, inter, x.dtype, "meta", block_m)
        for name in ("sorted_pairs", "block_expert", "h", "y"):
            got, need = getattr(workspace, name), getattr(want, name)
            if got.shape != need.shape or got.dtype != need.dtype or got.device != x.device or not got.is_contiguous():
                raise ValueError(f"workspace.{name} must be a contiguous {need.dtype} {list(need.shape)} on "
                                 f"{x.device}, got {got.dtype} {list(got.shape)} on {got.device}")
    if tokens * top_k == 0:
        return out.zero_()
    blocks = align_by_expert(ids, experts, block_m, out=(workspace.sorted_pairs, workspace.block_expert))
    _launch(x, w_gate_up, w_down, weights, blocks, workspace, out, block_n, block_k)
    return out


def _launch(x, w_gate_up, w_down, weights, blocks: ExpertBlocks, ws: Workspace, out, block_n, block_k) -> None:
    (tokens, hidden), (_, inter, _) = x.shape, w_down.shape
    n_blocks, top_k = blocks.block_expert.numel(), weights.shape[1]
    flags = dict(DOT_F32=x.dtype == torch.bfloat16 and knobs.runtime.interpret,
                 PRECISION="ieee" if x.dtype == torch.float32 else "tf32")  # tf32: ignored for 16-bit inputs
    tiles = dict(BLOCK_M=blocks.block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=NUM_WARPS, num_stages=NUM_STAGES)
    _gate_up_kernel[(n_blocks, triton.cdiv(inter, block_n))](
        x, w_gate_up, blocks.sorted_pairs, blocks.block_expert, ws.h,
        blocks.num_pairs, top_k, hidden, inter,
        x.stride(0), w_gate_up.stride(0), w_gate_up.stride(1), ws.h.stride(0),
        **tiles, **flags,
    )
    _down_kernel[(n_blocks, triton.cdiv(hidden, block_n))](
        ws.h, w_down, weights, blocks.sorted_pairs, blocks.block_expert, ws.y,
        blocks.num_pairs, inter, hidden,
        ws.h.stride(0), w_down.stride(0), w_down.stride(1), ws.y.stride(0),
        **tiles, **flags,
    )
    _sum_choices_kernel[(tokens, triton.cdiv(hidden, SUM_BLOCK))](ws.y, out, hidden, TOP_K=top_k, BLOCK=SUM_BLOCK,
                                                                  num_warps=NUM_WARPS)
