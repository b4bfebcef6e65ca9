"""INT4 weight tiles for tl.dot (moe_kernels.py's W4 path): one expert's packed words and group
scales (compressed-tensors' layout, ops/int4.py) turned into a [BLOCK_K, BLOCK_N] tile of the
activations' dtype, q * scale rounded once, as int4.dequantize_int4 rounds. At hundreds of rows per
expert the unpacking, not the tensor cores, bounds the kernel, so there are two ways to do it
(UNPACK, ops/moe_int4.py's INT4_UNPACK; benchmarks/moe_paths.py times them):

    word     each row's BLOCK_K / 8 words read once (16-byte vectors), every value shifted out,
             converted to float32, scaled and rounded
    pairs    bf16 only, on sm_90 (inline PTX): two values at a time, each made a bf16 128 + v by
             one lop3 (the bits under bf16's exponent of 2^7), then one bf16x2 subtraction of 136
             (exact: q = v - 8) and one bf16x2 product with the scale (q * scale has at most 12
             significant bits, so the product is rounded once, to nearest): the same bits as the
             float32 product rounded to bf16. "pairs_plain" is the same tile with the values
             computed in plain Triton (the interpreter, GPUs before sm_90)

A third, each element of the tile loading its own word, ran slowest of the three on an H100
(results/moe_paths-kimi-k2.6-int4-unpack-nvidia-h100.md) and was removed.

The group scales of a step are few (a [BLOCK_N, BLOCK_K / GROUP] tile) and 16 bits each: loaded one
per word, or one per group, a thread's share is under the 4 bytes an asynchronous copy moves, so the
pipeliner leaves the load in the step that uses it and every step waits on memory. With SCALE_PAIRS
they load as int32 words of two adjacent groups' scales, which it copies ahead like the weights.
"""

from __future__ import annotations

import triton
import triton.language as tl

def pairs_asm(scales: tuple[str, str, str, str]) -> str:
    """Inline PTX: word $8's values i and i + 4 (bits 4i and 4i + 16) into one register as two bf16
    128 + v (one lop3, (a & b) | c, table 0xEA), minus 136 (= q), times scales[i] (a bf16x2 operand,
    "{$9, $9}"), for i = 0 .. 3; outputs $i and $(i + 4) take the register's halves."""
    lines = [".reg .b32 w1, w2, w3, p0, p1, p2, p3, s0, s1, s2, s3, bias;"]
    lines += [f"mov.b32 s{i}, {scale};" for i, scale in enumerate(scales)]
    lines += ["mov.b32 bias, 0x43084308;", "lop3.b32 p0, $8, 0x000F000F, 0x43004300, 0xEA;"]
    for i in (1, 2, 3):
        lines += [f"shr.u32 w{i}, $8, {4 * i};", f"lop3.b32 p{i}, w{i}, 0x000F000F, 0x43004300, 0xEA;"]
    lines += [f"sub.rn.bf16x2 p{i}, p{i}, bias;" for i in range(4)]
    lines += [f"mul.rn.bf16x2 p{i}, p{i}, s{i};" for i in range(4)]
    lines += [f"mov.b32 {{${i}, ${i + 4}}}, p{i};" for i in range(4)]
    return "{\n" + "\n".join(lines) + "\n}"


# every value of a word times the word's one scale ($9)
PAIRS_ASM = tl.constexpr(pairs_asm(("{$9, $9}",) * 4))


@triton.jit
def _value(words, scale, i: tl.constexpr):
    """Value i of each word times its scale, rounded once to bf16 (the plain twin of PAIRS_ASM)."""
    return ((((words >> (4 * i)) & 0xF) - 8).to(tl.float32) * scale.to(tl.float32)).to(tl.bfloat16)


@triton.jit
def _pairs(words, scale, PTX: tl.constexpr):
    """words int32 [W, N], scale bf16 [W, N] -> bf16 [W, N, 2, 2, 2], value 4a + 2b + c of each word
    at [.., a, b, c]; PTX: through PAIRS_ASM, else plain Triton (the interpreter, GPUs before sm_90)."""
    if PTX:
        e = tl.inline_asm_elementwise(PAIRS_ASM, "=h,=h,=h,=h,=h,=h,=h,=h,r,h", [words, scale],
                                      dtype=(tl.bfloat16,) * 8, is_pure=True, pack=1)
        e0, e1, e2, e3, e4, e5, e6, e7 = e[0], e[1], e[2], e[3], e[4], e[5], e[6], e[7]
    else:
        e0, e1, e2, e3 = _value(words, scale, 0), _value(words, scale, 1), _value(words, scale, 2), \
            _value(words, scale, 3)
        e4, e5, e6, e7 = _value(words, scale, 4), _value(words, scale, 5), _value(words, scale, 6), \
            _value(words, scale, 7)
    return tl.join(tl.join(tl.join(e0, e4), tl.join(e2, e6)), tl.join(tl.join(e1, e5), tl.join(e3, e7)))


@triton.jit
def scale_half(pair, HIGH: tl.constexpr):
    """The bf16 scale in the low (even group) or high (odd group) half of an int32 pair of scales."""
    half = (pair >> 16) if HIGH else (pair & 0xFFFF)
    return half.to(tl.int16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _scale_pairs(scale_ptr, rows, k0, depth, col_ok, stride_sn, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 GROUP: tl.constexpr):
    """Each of the step's words' bf16 group scale, [BLOCK_K / 8, BLOCK_N], read as int32 words that
    hold groups 2j (low half) and 2j + 1 (high half) of a row. Needs GROUP to divide BLOCK_K at least
    twice and an even number of groups per row (stride_sn), so that no word straddles a row's end."""
    GROUPS: tl.constexpr = BLOCK_K // GROUP
    WORDS: tl.constexpr = BLOCK_K // 8
    pair = tl.multiple_of(k0 // (2 * GROUP), GROUPS // 2) + tl.arange(0, GROUPS // 2)
    mask = col_ok[:, None] & (pair * (2 * GROUP) < depth)[None, :]
    both = tl.load(scale_ptr.to(tl.pointer_type(tl.int32)) + rows * (stride_sn // 2) + pair[None, :], mask=mask,
                   other=0)  # [BLOCK_N, GROUPS / 2]
    scale = tl.trans(tl.reshape(tl.join(scale_half(both, False), scale_half(both, True)), (BLOCK_N, GROUPS)))
    return tl.reshape(tl.broadcast_to(scale[:, None, :], (GROUPS, WORDS // GROUPS, BLOCK_N)), (WORDS, BLOCK_N))


@triton.jit
def int4_tile(packed_ptr, scale_ptr, offs_n, k0, depth, col_ok, stride_pn, stride_sn,
              BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP: tl.constexpr, EVEN_K: tl.constexpr, DTYPE,
              UNPACK: tl.constexpr, SCALE_PAIRS: tl.constexpr = False):
    """W[k0 + i, n] for i < BLOCK_K and output rows offs_n [BLOCK_N] of one expert's INT4 weight
    (pointers at its [out, in / 8] words and [out, in / GROUP] scales), [BLOCK_K, BLOCK_N] in DTYPE,
    unpacked as UNPACK says ("word", "pairs" or "pairs_plain": the module's docstring). GROUP is a
    multiple of 8, so a word's 8 columns share their scale. EVEN_K: depth is a multiple of BLOCK_K,
    so no column is masked and the words load as 16-byte vectors. SCALE_PAIRS (pairs only; see
    moe_int4.scale_pairs for when it holds): the scales load two groups to a word (_scale_pairs)."""
    WORDS: tl.constexpr = BLOCK_K // 8
    word = tl.multiple_of(k0 // 8, WORDS) + tl.arange(0, WORDS)
    if EVEN_K:
        mask = tl.broadcast_to(col_ok[:, None], (BLOCK_N, WORDS))
    else:
        mask = col_ok[:, None] & (word * 8 < depth)[None, :]
    rows = offs_n.to(tl.int64)[:, None]
    if UNPACK == "pairs" or UNPACK == "pairs_plain":  # loaded [WORDS, BLOCK_N]: joined in the tile's order
        t_mask = tl.trans(mask)
        t_words = tl.load(packed_ptr + tl.trans(rows) * stride_pn + word[:, None], mask=t_mask, other=0)
        if SCALE_PAIRS:
            t_scale = _scale_pairs(scale_ptr, rows, k0, depth, col_ok, stride_sn, BLOCK_N, BLOCK_K, GROUP)
        else:
            t_scale = tl.load(scale_ptr + tl.trans(rows) * stride_sn + (word * 8 // GROUP)[:, None], mask=t_mask,
                              other=0.0)
        values = _pairs(t_words, t_scale, UNPACK == "pairs")  # [WORDS, BLOCK_N, 2, 2, 2]
        tile = tl.reshape(tl.permute(values, (0, 2, 3, 4, 1)), (BLOCK_K, BLOCK_N))
    else:
        words = tl.load(packed_ptr + rows * stride_pn + word[None, :], mask=mask, other=0)  # [BLOCK_N, WORDS]
        scale = tl.load(scale_ptr + rows * stride_sn + (word * 8 // GROUP)[None, :], mask=mask, other=0.0)
        q = ((words[:, :, None] >> (tl.arange(0, 8) * 4)[None, None, :]) & 0xF) - 8  # [BLOCK_N, WORDS, 8]
        w = (q.to(tl.float32) * scale.to(tl.float32)[:, :, None]).to(DTYPE)  # rounded to nearest, as torch rounds
        tile = tl.trans(tl.reshape(w, (BLOCK_N, BLOCK_K)))
    return tile
