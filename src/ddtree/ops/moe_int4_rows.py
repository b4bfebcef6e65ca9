"""INT4 routed experts at a few rows per expert (decode, tree verify): fused_moe's two GEMM kernels
with each routed block's rows multiplied one by one on the CUDA cores instead of through tl.dot.

At one to a few rows per expert a layer is a weight read, and what bounds the tl.dot path of
moe_kernels.py there is the unpacking: each INT4 value converted to float, scaled, rounded to
16 bits and moved into the tensor cores' operand layout. Here a packed word stays in the layout it
was loaded in; value i of a word (bits 4i .. 4i + 3, compressed-tensors' order) becomes a float
with two integer operations and one subtraction (`_nibble`), is multiplied by the activation of
its column, and the eight products of a word are summed before its group scale is applied once.
The activations' columns are taken apart to match with tl.split (no gather). Sums are float32
throughout and the weights are not rounded to 16 bits, so the result differs from the dequantized
twin's in the last bits (more accurate, not equal).

The shared experts (16-bit) keep moe_kernels' tl.dot tiles of SHARED_M tokens by SHARED_N = max(16,
BLOCK_N) columns in the same launches (programs past their columns exit);
the routed blocks hold ROWS pairs (moe_align with block_m = ROWS, or one pair each in DIRECT mode).
Row layout of h and y, arguments and sums as moe_kernels' gate_up_kernel and down_kernel.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .launch import wait_for_producers
from .moe_kernels import routed_block, shared_down, shared_gate_up

SHARED_M = 16  # tokens per shared-expert program (tl.dot's minimum)
_SHARED_M: tl.constexpr = tl.constexpr(SHARED_M)  # the kernels' copy


@triton.jit
def _nibble(words, i: tl.constexpr):
    """Value i of each packed int32 word minus 8 (the symmetric zero point), float32: the 4 bits set
    into the low mantissa of 2^23, then 2^23 + 8 subtracted; exact, with no int-to-float conversion."""
    bits = ((words >> (4 * i)) & 0xF) | 0x4B000000
    return bits.to(tl.float32, bitcast=True) - 8388616.0


@triton.jit
def _columns(a_ptrs, mask, ROWS: tl.constexpr, WORDS: tl.constexpr):
    """Activations [ROWS, 8 * WORDS] as float32, taken apart by column within each word: the tuple
    (x0, .., x7) of [ROWS, WORDS], xi[r, w] = a[r, 8 * w + i]."""
    a = tl.reshape(tl.load(a_ptrs, mask=mask, other=0.0).to(tl.float32), (ROWS, WORDS, 2, 2, 2))
    c0, c1 = tl.split(a)  # last axis: bit 0 of i
    c0b0, c0b1 = tl.split(c0)
    c1b0, c1b1 = tl.split(c1)
    x0, x4 = tl.split(c0b0)
    x2, x6 = tl.split(c0b1)
    x1, x5 = tl.split(c1b0)
    x3, x7 = tl.split(c1b1)
    return x0, x1, x2, x3, x4, x5, x6, x7


@triton.jit
def _word_sums(x0, x1, x2, x3, x4, x5, x6, x7, words):
    """[ROWS, BLOCK_N, WORDS]: per row and word, the sum of its 8 values times their activations."""
    acc = x0[:, None, :] * _nibble(words, 0)[None, :, :]
    acc += x1[:, None, :] * _nibble(words, 1)[None, :, :]
    acc += x2[:, None, :] * _nibble(words, 2)[None, :, :]
    acc += x3[:, None, :] * _nibble(words, 3)[None, :, :]
    acc += x4[:, None, :] * _nibble(words, 4)[None, :, :]
    acc += x5[:, None, :] * _nibble(words, 5)[None, :, :]
    acc += x6[:, None, :] * _nibble(words, 6)[None, :, :]
    acc += x7[:, None, :] * _nibble(words, 7)[None, :, :]
    return acc


@triton.jit
def _weight_words(packed_ptr, scale_ptr, rows, word, mask, stride_pn, stride_sn, GROUP: tl.constexpr):
    """(words int32, scales float32), both [BLOCK_N, WORDS], of weight rows `rows` at word columns `word`."""
    words = tl.load(packed_ptr + rows * stride_pn + word[None, :], mask=mask, other=0)
    scale = tl.load(scale_ptr + rows * stride_sn + (word * 8 // GROUP)[None, :], mask=mask, other=0.0)
    return words, scale.to(tl.float32)


@triton.jit
def _masks(row_ok, col_ok, k0, depth, ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
           EVEN_K: tl.constexpr):
    """(activations' mask [ROWS, BLOCK_K], words' mask [BLOCK_N, BLOCK_K / 8]) of the K step at k0;
    EVEN_K: the step is whole or past the end, one condition for all its columns (16-byte loads)."""
    if EVEN_K:
        inside = k0 < depth
        return (tl.broadcast_to(row_ok[:, None] & inside, (ROWS, BLOCK_K)),
                tl.broadcast_to(col_ok[:, None] & inside, (BLOCK_N, BLOCK_K // 8)))
    k = k0 + tl.arange(0, BLOCK_K)
    word = k0 // 8 + tl.arange(0, BLOCK_K // 8)
    return row_ok[:, None] & (k < depth)[None, :], col_ok[:, None] & (word * 8 < depth)[None, :]


@triton.jit
def _rows_times_w4(a_ptr, row_ok, packed_ptr, scale_ptr, offs_n, col_ok, depth, stride_pn, stride_sn,
                   ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP: tl.constexpr,
                   EVEN_K: tl.constexpr):
    """a [ROWS, depth] (pointers at column 0) times the INT4 weight's rows offs_n ([out, depth / 8]
    words): float32 [ROWS, BLOCK_N]. EVEN_K: depth is a multiple of BLOCK_K. Each step loads the
    next step's words before it multiplies its own (two steps' reads in flight)."""
    WORDS: tl.constexpr = BLOCK_K // 8
    rows = offs_n.to(tl.int64)[:, None]
    words_at = tl.arange(0, WORDS)
    _, w_mask = _masks(row_ok, col_ok, 0, depth, ROWS, BLOCK_N, BLOCK_K, EVEN_K)
    words, scale = _weight_words(packed_ptr, scale_ptr, rows, words_at, w_mask, stride_pn, stride_sn, GROUP)
    acc = tl.zeros([ROWS, BLOCK_N, WORDS], tl.float32)
    for k0 in range(0, depth, BLOCK_K):
        x_mask, _ = _masks(row_ok, col_ok, k0, depth, ROWS, BLOCK_N, BLOCK_K, EVEN_K)
        _, next_mask = _masks(row_ok, col_ok, k0 + BLOCK_K, depth, ROWS, BLOCK_N, BLOCK_K, EVEN_K)
        next_words, next_scale = _weight_words(packed_ptr, scale_ptr, rows, (k0 + BLOCK_K) // 8 + words_at, next_mask,
                                               stride_pn, stride_sn, GROUP)
        x0, x1, x2, x3, x4, x5, x6, x7 = _columns(a_ptr + (k0 + tl.arange(0, BLOCK_K))[None, :], x_mask, ROWS, WORDS)
        acc += _word_sums(x0, x1, x2, x3, x4, x5, x6, x7, words) * scale[None, :, :]
        words, scale = next_words, next_scale
    return tl.sum(acc, 2)


@triton.jit
def _swiglu_rows_w4(a_ptr, row_ok, packed_ptr, scale_ptr, offs_n, col_ok, hidden, inter, stride_pn, stride_sn,
                    ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP: tl.constexpr,
                    EVEN_K: tl.constexpr):
    """silu(a @ Wg) * (a @ Wu) for gate rows offs_n and up rows inter + offs_n: float32 [ROWS, BLOCK_N]
    (the next step's words loaded ahead, as in _rows_times_w4)."""
    WORDS: tl.constexpr = BLOCK_K // 8
    gate_rows = offs_n.to(tl.int64)[:, None]
    up_rows = gate_rows + inter
    words_at = tl.arange(0, WORDS)
    _, w_mask = _masks(row_ok, col_ok, 0, hidden, ROWS, BLOCK_N, BLOCK_K, EVEN_K)
    gate_words, gate_scale = _weight_words(packed_ptr, scale_ptr, gate_rows, words_at, w_mask, stride_pn, stride_sn,
                                           GROUP)
    up_words, up_scale = _weight_words(packed_ptr, scale_ptr, up_rows, words_at, w_mask, stride_pn, stride_sn, GROUP)
    acc_gate = tl.zeros([ROWS, BLOCK_N, WORDS], tl.float32)
    acc_up = tl.zeros([ROWS, BLOCK_N, WORDS], tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        x_mask, _ = _masks(row_ok, col_ok, k0, hidden, ROWS, BLOCK_N, BLOCK_K, EVEN_K)
        _, next_mask = _masks(row_ok, col_ok, k0 + BLOCK_K, hidden, ROWS, BLOCK_N, BLOCK_K, EVEN_K)
        next_word = (k0 + BLOCK_K) // 8 + words_at
        next_gate, next_gate_scale = _weight_words(packed_ptr, scale_ptr, gate_rows, next_word, next_mask, stride_pn,
                                                   stride_sn, GROUP)
        next_up, next_up_scale = _weight_words(packed_ptr, scale_ptr, up_rows, next_word, next_mask, stride_pn,
                                               stride_sn, GROUP)
        x0, x1, x2, x3, x4, x5, x6, x7 = _columns(a_ptr + (k0 + tl.arange(0, BLOCK_K))[None, :], x_mask, ROWS, WORDS)
        acc_gate += _word_sums(x0, x1, x2, x3, x4, x5, x6, x7, gate_words) * gate_scale[None, :, :]
        acc_up += _word_sums(x0, x1, x2, x3, x4, x5, x6, x7, up_words) * up_scale[None, :, :]
        gate_words, gate_scale, up_words, up_scale = next_gate, next_gate_scale, next_up, next_up_scale
    gate = tl.sum(acc_gate, 2)
    return gate * tl.sigmoid(gate) * tl.sum(acc_up, 2)


@triton.jit
def gate_up_rows_kernel(
    x_ptr, w_ptr, sorted_pairs_ptr, block_expert_ptr, h_ptr, shared_gate_ptr, shared_up_ptr, scale_ptr,
    num_pairs, num_experts, num_tokens, top_k, hidden, inter, routed_blocks, token_blocks,
    stride_xt, stride_we, stride_wk, stride_hp, stride_shared, stride_se, stride_sn,
    ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP: tl.constexpr,
    DOT_F32: tl.constexpr, PRECISION: tl.constexpr, DIRECT: tl.constexpr, PDL: tl.constexpr, EVEN_K: tl.constexpr,
    SHARED_N: tl.constexpr,
):
    """moe_kernels.gate_up_kernel (W4) with ROWS pairs per routed block; token_blocks counts blocks
    of SHARED_M tokens; EVEN_K: hidden and inter are multiples of BLOCK_K."""
    wait_for_producers(PDL)
    pid_m = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = offs_n < inter
    if pid_m < routed_blocks:
        expert, pair = routed_block(pid_m, sorted_pairs_ptr, block_expert_ptr, num_pairs, num_experts, ROWS, DIRECT)
        if expert >= 0:
            row_ok = pair < num_pairs
            e = expert.to(tl.int64)
            x_rows = x_ptr + (pair // top_k).to(tl.int64)[:, None] * stride_xt
            h = _swiglu_rows_w4(x_rows, row_ok, w_ptr + e * stride_we, scale_ptr + e * stride_se, offs_n, col_ok,
                                hidden, inter, stride_wk, stride_sn, ROWS, BLOCK_N, BLOCK_K, GROUP, EVEN_K)
            h_ptrs = h_ptr + pair.to(tl.int64)[:, None] * stride_hp + offs_n[None, :]
            tl.store(h_ptrs, h.to(h_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])
    elif tl.program_id(1) * SHARED_N < inter:  # shared tiles of SHARED_N >= 16 columns (tl.dot's least)
        shared_n = tl.program_id(1) * SHARED_N + tl.arange(0, SHARED_N)
        shared_gate_up(pid_m, shared_n, shared_n < inter, x_ptr, h_ptr, shared_gate_ptr, shared_up_ptr, num_pairs,
                       num_tokens, hidden, inter, routed_blocks, token_blocks, stride_xt, stride_hp, stride_shared,
                       _SHARED_M, SHARED_N, BLOCK_K, DOT_F32, PRECISION)


@triton.jit
def down_rows_kernel(
    h_ptr, w_ptr, weights_ptr, sorted_pairs_ptr, block_expert_ptr, y_ptr, shared_down_ptr, scale_ptr,
    num_pairs, num_experts, num_tokens, inter, hidden, routed_blocks, token_blocks,
    stride_hp, stride_we, stride_wk, stride_yp, stride_shared, stride_se, stride_sn,
    ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP: tl.constexpr,
    DOT_F32: tl.constexpr, PRECISION: tl.constexpr, DIRECT: tl.constexpr, PDL: tl.constexpr, EVEN_K: tl.constexpr,
    SHARED_N: tl.constexpr,
):
    """moe_kernels.down_kernel (W4) with ROWS pairs per routed block (as gate_up_rows_kernel)."""
    wait_for_producers(PDL)
    pid_m = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = offs_n < hidden
    if pid_m < routed_blocks:
        expert, pair = routed_block(pid_m, sorted_pairs_ptr, block_expert_ptr, num_pairs, num_experts, ROWS, DIRECT)
        if expert >= 0:
            row_ok = pair < num_pairs
            row = tl.where(row_ok, pair, 0).to(tl.int64)
            e = expert.to(tl.int64)
            acc = _rows_times_w4(h_ptr + row[:, None] * stride_hp, row_ok, w_ptr + e * stride_we,
                                 scale_ptr + e * stride_se, offs_n, col_ok, inter, stride_wk, stride_sn,
                                 ROWS, BLOCK_N, BLOCK_K, GROUP, EVEN_K)
            weight = tl.load(weights_ptr + row, mask=row_ok, other=0.0)
            tl.store(y_ptr + row[:, None] * stride_yp + offs_n[None, :], acc * weight[:, None],
                     mask=row_ok[:, None] & col_ok[None, :])
    elif tl.program_id(1) * SHARED_N < hidden:  # as in gate_up_rows_kernel
        shared_n = tl.program_id(1) * SHARED_N + tl.arange(0, SHARED_N)
        shared_down(pid_m, shared_n, shared_n < hidden, h_ptr, y_ptr, shared_down_ptr, num_pairs, num_tokens, inter,
                    routed_blocks, token_blocks, stride_hp, stride_yp, stride_shared,
                    _SHARED_M, SHARED_N, BLOCK_K, DOT_F32, PRECISION)
