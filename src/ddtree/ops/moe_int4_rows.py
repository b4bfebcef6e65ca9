"""INT4 routed experts at a few rows per expert (decode, tree verify): fused_moe's two GEMM kernels
with each routed block's rows multiplied one by one on the CUDA cores instead of through tl.dot.

At one to a few rows per expert a layer is a weight read, and what bounds the tl.dot path of
moe_kernels.py there is the unpacking: each INT4 value converted to float, scaled, rounded to
16 bits and moved into the tensor cores' operand layout. Here a packed word stays in the layout it
was loaded in; value i of a word (bits 4i .. 4i + 3, compressed-tensors' order) becomes the float
2^16 (128 + q + 8) with a shift and a mask-or (`_biased`, no int-to-float conversion), is multiplied by
its column's activation scaled by 2^-16, and the eight products of a word start from -136 times the
activations' sum, so that they add up to sum(x * q) with one fused multiply-add per value; the word's
group scale is applied once. The activations' columns are taken apart to match with tl.split (no
gather). Sums are float32 throughout and the weights are not rounded to 16 bits, so the result
differs from the dequantized twin's in the last bits (not equal, within float32's rounding).

Only the routed experts run here, each program on one output block of one weight, so that a program
holds one accumulator and one set of words: gate_up_rows_kernel writes gate and up, float32, side by
side into gu [P, 2 * inter], and down_rows_kernel takes silu(gate) * up of its rows (rounded to the
activations' dtype, as moe_kernels' h is) as it loads them. The shared experts (16-bit) run in
launches of their own through moe_kernels' tl.dot kernels (fused_moe). Routed blocks hold ROWS
pairs (moe_align with block_m = ROWS, or one pair each in DIRECT mode); y as moe_kernels'.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .launch import wait_for_producers
from .moe_kernels import routed_block


@triton.jit
def _biased(words, i: tl.constexpr):
    """Value i of each packed int32 word as the float32 2^16 * (128 + v), v its 4 bits (q + 8): the
    bits moved to 16 .. 19 and the exponent of 2^23 set, whose unit there is 2^16; exact."""
    if i < 4:
        bits = (words << (16 - 4 * i)) & 0xF0000
    elif i == 4:
        bits = words & 0xF0000
    else:
        bits = (words >> (4 * i - 16)) & 0xF0000
    return (bits | 0x4B000000).to(tl.float32, bitcast=True)


@triton.jit
def _activations(a_ptrs, mask, up_offset, SWIGLU: tl.constexpr, DTYPE: tl.constexpr):
    """The K step's activations as float32: a_ptrs' values, or (SWIGLU) silu(gate) * up of the float32
    gate at a_ptrs and up at a_ptrs + up_offset, rounded to DTYPE first (as moe_kernels' h is stored)."""
    if SWIGLU:
        gate = tl.load(a_ptrs, mask=mask, other=0.0)
        up = tl.load(a_ptrs + up_offset, mask=mask, other=0.0)
        return (gate * tl.sigmoid(gate) * up).to(DTYPE).to(tl.float32)
    return tl.load(a_ptrs, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _columns(a, ROWS: tl.constexpr, WORDS: tl.constexpr):
    """Activations a [ROWS, 8 * WORDS] taken apart by column within each word, times 2^-16 (exact):
    ((x0, .., x7) each [ROWS, WORDS] with xi[r, w] = a[r, 8 * w + i] / 2^16, and -136 times the
    sum of each word's 8 activations, [ROWS, WORDS])."""
    c0, c1 = tl.split(tl.reshape(a * (1.0 / 65536.0), (ROWS, WORDS, 2, 2, 2)))  # last axis: bit 0 of i
    c0b0, c0b1 = tl.split(c0)
    c1b0, c1b1 = tl.split(c1)
    x0, x4 = tl.split(c0b0)
    x2, x6 = tl.split(c0b1)
    x1, x5 = tl.split(c1b0)
    x3, x7 = tl.split(c1b1)
    # the products start from -136 * 2^16 * (their activations' sum / 2^16): 128 + v - 136 = q
    bias = ((x0 + x1) + (x2 + x3) + ((x4 + x5) + (x6 + x7))) * -8912896.0
    return x0, x1, x2, x3, x4, x5, x6, x7, bias


@triton.jit
def _word_sums(x0, x1, x2, x3, x4, x5, x6, x7, bias, words):
    """[ROWS, BLOCK_N, WORDS]: per row and word, the sum of its 8 values q times their activations."""
    acc = bias[:, None, :] + x0[:, None, :] * _biased(words, 0)[None, :, :]
    acc += x1[:, None, :] * _biased(words, 1)[None, :, :]
    acc += x2[:, None, :] * _biased(words, 2)[None, :, :]
    acc += x3[:, None, :] * _biased(words, 3)[None, :, :]
    acc += x4[:, None, :] * _biased(words, 4)[None, :, :]
    acc += x5[:, None, :] * _biased(words, 5)[None, :, :]
    acc += x6[:, None, :] * _biased(words, 6)[None, :, :]
    acc += x7[:, None, :] * _biased(words, 7)[None, :, :]
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
def _rows_times_w4(a_ptr, row_ok, up_offset, packed_ptr, scale_ptr, offs_n, col_ok, depth, stride_pn, stride_sn,
                   ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP: tl.constexpr,
                   EVEN_K: tl.constexpr, SWIGLU: tl.constexpr, DTYPE: tl.constexpr):
    """a [ROWS, depth] (pointers at column 0; SWIGLU: silu(gate) * up, see _activations) times the
    INT4 weight's rows offs_n ([out, depth / 8] words): float32 [ROWS, BLOCK_N]. EVEN_K: depth is a
    multiple of BLOCK_K. Each step loads the next step's words before it multiplies its own (two
    steps' reads in flight)."""
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
        a = _activations(a_ptr + (k0 + tl.arange(0, BLOCK_K))[None, :], x_mask, up_offset, SWIGLU, DTYPE)
        x0, x1, x2, x3, x4, x5, x6, x7, bias = _columns(a, ROWS, WORDS)
        acc += _word_sums(x0, x1, x2, x3, x4, x5, x6, x7, bias, words) * scale[None, :, :]
        words, scale = next_words, next_scale
    return tl.sum(acc, 2)


@triton.jit
def gate_up_rows_kernel(
    x_ptr, w_ptr, sorted_pairs_ptr, block_expert_ptr, gu_ptr, scale_ptr,
    num_pairs, num_experts, top_k, hidden, width, stride_xt, stride_we, stride_wk, stride_gu, stride_se, stride_sn,
    ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP: tl.constexpr,
    DIRECT: tl.constexpr, PDL: tl.constexpr, EVEN_K: tl.constexpr,
):
    """gu[p, n] = x[token of p] @ W[e][n] (float32) for n < width = 2 * inter: the gate rows, then the
    up rows, of each routed pair p's expert e (packed int32 [E, 2 * inter, hidden / 8], stride_we per
    expert, stride_wk per row; scales [E, 2 * inter, hidden / GROUP], stride_se, stride_sn); one
    program per routed block of ROWS pairs and BLOCK_N of the 2 * inter rows. EVEN_K: hidden is a
    multiple of BLOCK_K."""
    wait_for_producers(PDL)
    pid_m = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = offs_n < width
    expert, pair = routed_block(pid_m, sorted_pairs_ptr, block_expert_ptr, num_pairs, num_experts, ROWS, DIRECT)
    if expert >= 0:
        row_ok = pair < num_pairs
        e = expert.to(tl.int64)
        x_rows = x_ptr + (pair // top_k).to(tl.int64)[:, None] * stride_xt
        gu = _rows_times_w4(x_rows, row_ok, 0, w_ptr + e * stride_we, scale_ptr + e * stride_se, offs_n, col_ok,
                            hidden, stride_wk, stride_sn, ROWS, BLOCK_N, BLOCK_K, GROUP, EVEN_K, False, tl.float32)
        gu_ptrs = gu_ptr + pair.to(tl.int64)[:, None] * stride_gu + offs_n[None, :]
        tl.store(gu_ptrs, gu, mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def down_rows_kernel(
    gu_ptr, w_ptr, weights_ptr, sorted_pairs_ptr, block_expert_ptr, y_ptr, scale_ptr,
    num_pairs, num_experts, inter, hidden, stride_gu, stride_we, stride_wk, stride_yp, stride_se, stride_sn,
    ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP: tl.constexpr,
    DIRECT: tl.constexpr, PDL: tl.constexpr, EVEN_K: tl.constexpr, DTYPE: tl.constexpr,
):
    """y[p] = weights[p] * (h[p] @ Wd[e]), float32, per routed pair p, with h = silu(gate) * up of
    gu's row p rounded to DTYPE (the activations'); Wd packed [E, hidden, inter / 8]. EVEN_K: inter is
    a multiple of BLOCK_K."""
    wait_for_producers(PDL)
    pid_m = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = offs_n < hidden
    expert, pair = routed_block(pid_m, sorted_pairs_ptr, block_expert_ptr, num_pairs, num_experts, ROWS, DIRECT)
    if expert >= 0:
        row_ok = pair < num_pairs
        row = tl.where(row_ok, pair, 0).to(tl.int64)
        e = expert.to(tl.int64)
        acc = _rows_times_w4(gu_ptr + row[:, None] * stride_gu, row_ok, inter, w_ptr + e * stride_we,
                             scale_ptr + e * stride_se, offs_n, col_ok, inter, stride_wk, stride_sn,
                             ROWS, BLOCK_N, BLOCK_K, GROUP, EVEN_K, True, DTYPE)
        weight = tl.load(weights_ptr + row, mask=row_ok, other=0.0)
        tl.store(y_ptr + row[:, None] * stride_yp + offs_n[None, :], acc * weight[:, None],
                 mask=row_ok[:, None] & col_ok[None, :])
