"""INT4 experts in the group-interleaved order (int4.interleave_int4) for fused_moe's tl.dot kernels
(moe_kernels.py, UNPACK "interleaved"): the weights are the dot's first operand, kept in registers.

In compressed-tensors' order a word holds 8 adjacent columns, so a [BLOCK_K, BLOCK_N] tile is
joined, permuted and stored to shared memory before the tensor cores read it (int4_tiles.py). Here,
in each 256-column block, nibbles i and i + 4 of word w hold columns 2c and 2c + 1 (c = w % 16) of
group 4 (w // 16) + i % 4. So one lop3 makes a register of two adjacent columns of one group (the
pair the tensor cores' operand layout puts in a register), nibble i of 16 words is a whole
32-column group (one scale per output row), and every step is elementwise from the loaded words:
the compiler unpacks them in the operand layout itself (no shared-memory round trip). The product
is computed transposed, acc^T [BLOCK_N, BLOCK_M] = W [BLOCK_N, 128] @ x^T [128, BLOCK_M] per half
block (its four groups' values relabeled to the natural column order, which moves no register
between threads), so the weights, not the few rows, fill the tensor cores' 64-row side.

Values are q * scale rounded once to bf16, as int4.dequantize_int4 rounds; the sums run 128 columns
at a time, so they are not the dequantized twin's to the bit (within float32 rounding). Needs bf16
activations and scales, group size 32 and depths a positive multiple of 256 (moe_int4.check_int4).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .int4_tiles import pairs_asm, scale_half
from .launch import dot

# values i and i + 4 of a word are two columns of group i: their register times scale $9 + i
PAIRS_OF_GROUP_ASM = tl.constexpr(pairs_asm(("{$9, $9}", "{$10, $10}", "{$11, $11}", "{$12, $12}")))


@triton.jit
def _nibble(words, scale, i: tl.constexpr):
    """Value i of each word times its row's scale, rounded once to bf16 (the plain twin)."""
    return ((((words >> (4 * i)) & 0xF) - 8).to(tl.float32) * scale.to(tl.float32)[:, None]).to(tl.bfloat16)


@triton.jit
def _half_block(acc, a_rows, row_ok, words, s0, s1, s2, s3, k0, BLOCK_N: tl.constexpr, DOT_F32: tl.constexpr,
                PTX: tl.constexpr):
    """acc^T += the four groups k0 .. k0 + 127 held by words [BLOCK_N, 16] (scales s0 .. s3 [BLOCK_N])
    times the activation rows a_rows [BLOCK_M] (pointers at column 0)."""
    if PTX:
        shape: tl.constexpr = (BLOCK_N, 16)
        e = tl.inline_asm_elementwise(PAIRS_OF_GROUP_ASM, "=h,=h,=h,=h,=h,=h,=h,=h,r,h,h,h,h",
                                      [words, tl.broadcast_to(s0[:, None], shape), tl.broadcast_to(s1[:, None], shape),
                                       tl.broadcast_to(s2[:, None], shape), tl.broadcast_to(s3[:, None], shape)],
                                      dtype=(tl.bfloat16,) * 8, is_pure=True, pack=1)
    else:
        e = (_nibble(words, s0, 0), _nibble(words, s1, 1), _nibble(words, s2, 2), _nibble(words, s3, 3),
             _nibble(words, s0, 4), _nibble(words, s1, 5), _nibble(words, s2, 6), _nibble(words, s3, 7))
    # [n, c, j, b, a] = column 2c + j of group 2a + b, permuted to the natural order 64a + 32b + 2c + j
    # (each thread holds the same words for every group, so this relabels registers)
    pairs = tl.join(tl.join(tl.join(e[0], e[4]), tl.join(e[1], e[5])), tl.join(tl.join(e[2], e[6]), tl.join(e[3], e[7])))
    w = tl.reshape(tl.permute(pairs, (0, 4, 3, 1, 2)), (BLOCK_N, 128))
    a = tl.load(a_rows[:, None] + (k0 + tl.arange(0, 128))[None, :], mask=row_ok[:, None], other=0.0)
    acc = dot(w, tl.trans(a).to(tl.bfloat16), acc, DOT_F32, "tf32")
    return acc


@triton.jit
def _block(acc, a_rows, row_ok, packed_ptr, scale_ptr, offs_n, col_ok, k0, stride_pn, stride_sn,
           BLOCK_N: tl.constexpr, DOT_F32: tl.constexpr, PTX: tl.constexpr):
    """acc^T [BLOCK_N, BLOCK_M] += rows offs_n of the weight over the 256 columns from k0."""
    rows = offs_n.to(tl.int64)
    word = k0 // 8 + tl.arange(0, 16)
    low = tl.load(packed_ptr + rows[:, None] * stride_pn + word[None, :], mask=col_ok[:, None], other=0)
    high = tl.load(packed_ptr + rows[:, None] * stride_pn + (word + 16)[None, :], mask=col_ok[:, None], other=0)
    # the block's 8 scales as 4 int32 words of two (32-bit loads: the pipeliner copies them ahead)
    pairs = scale_ptr.to(tl.pointer_type(tl.int32)) + rows * (stride_sn // 2) + k0 // 64
    p0 = tl.load(pairs, mask=col_ok, other=0)
    p1 = tl.load(pairs + 1, mask=col_ok, other=0)
    p2 = tl.load(pairs + 2, mask=col_ok, other=0)
    p3 = tl.load(pairs + 3, mask=col_ok, other=0)
    acc = _half_block(acc, a_rows, row_ok, low, scale_half(p0, False), scale_half(p0, True), scale_half(p1, False),
                      scale_half(p1, True), k0, BLOCK_N, DOT_F32, PTX)
    return _half_block(acc, a_rows, row_ok, high, scale_half(p2, False), scale_half(p2, True), scale_half(p3, False),
                       scale_half(p3, True), k0 + 128, BLOCK_N, DOT_F32, PTX)


@triton.jit
def _half(acc, a_rows, row_ok, packed_ptr, scale_ptr, offs_n, col_ok, k0, stride_pn, stride_sn,
          BLOCK_N: tl.constexpr, DOT_F32: tl.constexpr, PTX: tl.constexpr):
    """acc^T += rows offs_n of the weight over the 128 columns from k0 (a multiple of 128): one half
    block's 16 words and 4 scales, so a step holds half a block's unpacked operand."""
    rows = offs_n.to(tl.int64)
    words = tl.load(packed_ptr + rows[:, None] * stride_pn + (k0 // 8 + tl.arange(0, 16))[None, :],
                    mask=col_ok[:, None], other=0)
    pairs = scale_ptr.to(tl.pointer_type(tl.int32)) + rows * (stride_sn // 2) + k0 // 64
    p0 = tl.load(pairs, mask=col_ok, other=0)
    p1 = tl.load(pairs + 1, mask=col_ok, other=0)
    return _half_block(acc, a_rows, row_ok, words, scale_half(p0, False), scale_half(p0, True), scale_half(p1, False),
                       scale_half(p1, True), k0, BLOCK_N, DOT_F32, PTX)


@triton.jit
def _step(acc, a_rows, row_ok, packed_ptr, scale_ptr, offs_n, col_ok, k0, stride_pn, stride_sn,
          BLOCK_N: tl.constexpr, DOT_F32: tl.constexpr, PTX: tl.constexpr, STEP: tl.constexpr):
    """One K step of STEP columns from k0: a whole 256-column block, or half of one (128)."""
    tl.static_assert(STEP == 128 or STEP == 256, "interleaved INT4 tiles step 128 or 256 columns")
    if STEP == 128:
        acc = _half(acc, a_rows, row_ok, packed_ptr, scale_ptr, offs_n, col_ok, k0, stride_pn, stride_sn,
                    BLOCK_N, DOT_F32, PTX)
    else:
        acc = _block(acc, a_rows, row_ok, packed_ptr, scale_ptr, offs_n, col_ok, k0, stride_pn, stride_sn,
                     BLOCK_N, DOT_F32, PTX)
    return acc


@triton.jit
def swiglu_tile_w4i(a_rows, row_ok, packed_ptr, scale_ptr, offs_n, col_ok, inter, hidden, stride_pn, stride_sn,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_F32: tl.constexpr, PTX: tl.constexpr,
                    STEP: tl.constexpr = 256):
    """silu(x @ Wg) * (x @ Wu), float32 [BLOCK_M, BLOCK_N], for activation rows a_rows [BLOCK_M]
    (pointers at column 0) and gate rows offs_n, up rows inter + offs_n of one expert's interleaved
    weight (packed_ptr, scale_ptr at the expert). hidden: a positive multiple of 256; STEP: columns a K
    step multiplies (256: a whole interleaved block; 128: half, fewer registers a step)."""
    # The loop runs at least once: otherwise the zeros it would hand on are an accumulator that
    # other instructions define while a wgmma may be in flight, and ptxas serializes every wgmma
    # of the kernel (its advisory C7515), each waiting for the last.
    acc_gate = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    acc_up = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    tl.assume(hidden >= 256)
    for k0 in range(0, hidden, STEP):
        acc_gate = _step(acc_gate, a_rows, row_ok, packed_ptr, scale_ptr, offs_n, col_ok, k0, stride_pn, stride_sn,
                         BLOCK_N, DOT_F32, PTX, STEP)
        acc_up = _step(acc_up, a_rows, row_ok, packed_ptr, scale_ptr, inter + offs_n, col_ok, k0, stride_pn,
                       stride_sn, BLOCK_N, DOT_F32, PTX, STEP)
    gate, up = tl.trans(acc_gate), tl.trans(acc_up)
    return gate * tl.sigmoid(gate) * up


@triton.jit
def matmul_tile_w4i(a_rows, row_ok, packed_ptr, scale_ptr, offs_n, col_ok, depth, stride_pn, stride_sn,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_F32: tl.constexpr, PTX: tl.constexpr,
                    STEP: tl.constexpr = 256):
    """a @ W^T for rows offs_n of one expert's interleaved weight [out, depth]: float32 [BLOCK_M, BLOCK_N]
    (STEP as in swiglu_tile_w4i)."""
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    tl.assume(depth >= 256)  # as in swiglu_tile_w4i
    for k0 in range(0, depth, STEP):
        acc = _step(acc, a_rows, row_ok, packed_ptr, scale_ptr, offs_n, col_ok, k0, stride_pn, stride_sn,
                    BLOCK_N, DOT_F32, PTX, STEP)
    return tl.trans(acc)
