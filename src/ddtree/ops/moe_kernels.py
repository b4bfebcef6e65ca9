"""The Triton kernels behind fused_moe (moe.py has the layout, the checks and the launch).

Routed pairs p = token * k + choice come grouped by expert in blocks (moe_align). Shared experts,
when given, are S more SwiGLU experts of the routed width that every token takes with weight 1:
their programs follow the routed blocks in the same launch (block j past the routed ones: shared
expert j // token_blocks, tokens (j % token_blocks) * BLOCK_M + 0 .. BLOCK_M - 1), and their rows
of h and y follow the routed pairs' (row P + s * T + token). They read the shared MLP's nn.Linear
weights in place, [out, in] with `in` contiguous, where the routed experts' are [E, in, out].

W4: the routed experts' weights are INT4 in compressed-tensors' layout instead (ops/int4.py):
packed int32 [E, out, in / 8] and a scale [E, out, in / GROUP] per weight. A tile is unpacked and
dequantized in registers (int4_tiles.py: q * scale rounded once to the activations' dtype, as
int4.dequantize_int4 rounds) and multiplied like a 16-bit one: the same sums, in the same order.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .int4_interleaved import matmul_tile_w4i, swiglu_tile_w4i
from .int4_tiles import int4_tile
from .launch import dot, matmul_tile, wait_for_producers


@triton.jit
def _swiglu_tile(x_ptrs, gate_ptrs, up_ptrs, w_step, row_ok, col_ok, hidden,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 DOT_F32: tl.constexpr, PRECISION: tl.constexpr):
    """silu(x @ Wg) * (x @ Wu) for one [BLOCK_M, BLOCK_N] tile, float32; pointers at k = 0."""
    offs_k = tl.arange(0, BLOCK_K)
    acc_gate = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        k_ok = offs_k < hidden - k0
        a = tl.load(x_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w_mask = k_ok[:, None] & col_ok[None, :]
        acc_gate = dot(a, tl.load(gate_ptrs, mask=w_mask, other=0.0), acc_gate, DOT_F32, PRECISION)
        acc_up = dot(a, tl.load(up_ptrs, mask=w_mask, other=0.0), acc_up, DOT_F32, PRECISION)
        x_ptrs += BLOCK_K
        gate_ptrs += w_step
        up_ptrs += w_step
    return acc_gate * tl.sigmoid(acc_gate) * acc_up


@triton.jit
def _swiglu_tile_w4(x_ptrs, packed_ptr, scale_ptr, offs_n, inter, row_ok, col_ok, hidden, stride_pn, stride_sn, dtype,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP: tl.constexpr,
                    EVEN_K: tl.constexpr, DOT_F32: tl.constexpr, PRECISION: tl.constexpr, UNPACK: tl.constexpr,
                    SCALE_PAIRS: tl.constexpr):
    """_swiglu_tile with an INT4 expert: gate rows offs_n, up rows inter + offs_n; dtype: x's."""
    offs_k = tl.arange(0, BLOCK_K)
    acc_gate = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        a = tl.load(x_ptrs, mask=row_ok[:, None] & (k0 + offs_k < hidden)[None, :], other=0.0)
        gate = int4_tile(packed_ptr, scale_ptr, offs_n, k0, hidden, col_ok, stride_pn, stride_sn,
                          BLOCK_N, BLOCK_K, GROUP, EVEN_K, dtype, UNPACK, SCALE_PAIRS)
        acc_gate = dot(a, gate, acc_gate, DOT_F32, PRECISION)
        up = int4_tile(packed_ptr, scale_ptr, inter + offs_n, k0, hidden, col_ok, stride_pn, stride_sn,
                        BLOCK_N, BLOCK_K, GROUP, EVEN_K, dtype, UNPACK, SCALE_PAIRS)
        acc_up = dot(a, up, acc_up, DOT_F32, PRECISION)
        x_ptrs += BLOCK_K
    return acc_gate * tl.sigmoid(acc_gate) * acc_up


@triton.jit
def _matmul_tile_w4(a_ptrs, packed_ptr, scale_ptr, offs_n, row_ok, col_ok, depth, stride_pn, stride_sn, dtype,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP: tl.constexpr,
                    EVEN_K: tl.constexpr, DOT_F32: tl.constexpr, PRECISION: tl.constexpr, UNPACK: tl.constexpr,
                    SCALE_PAIRS: tl.constexpr):
    """launch.matmul_tile with an INT4 expert weight [out, depth]; dtype: a's."""
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, depth, BLOCK_K):
        a = tl.load(a_ptrs, mask=row_ok[:, None] & (k0 + offs_k < depth)[None, :], other=0.0)
        w = int4_tile(packed_ptr, scale_ptr, offs_n, k0, depth, col_ok, stride_pn, stride_sn,
                       BLOCK_N, BLOCK_K, GROUP, EVEN_K, dtype, UNPACK, SCALE_PAIRS)
        acc = dot(a, w, acc, DOT_F32, PRECISION)
        a_ptrs += BLOCK_K
    return acc


@triton.jit
def routed_block(pid_m, sorted_pairs_ptr, block_expert_ptr, num_pairs, num_experts,
                 BLOCK_M: tl.constexpr, DIRECT: tl.constexpr):
    """(expert, pairs [BLOCK_M]) of routed program pid_m; expert -1: nothing to do. DIRECT: one
    pair per program, pair pid_m, and block_expert_ptr is the router's ids itself (no alignment:
    a single token's choices are distinct experts); padding lanes hold num_pairs."""
    expert = tl.load(block_expert_ptr + pid_m)
    if DIRECT:
        expert = tl.where((expert >= 0) & (expert < num_experts), expert, -1)
        pair = tl.where(tl.arange(0, BLOCK_M) == 0, pid_m, num_pairs)
    else:
        pair = tl.load(sorted_pairs_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    return expert, pair


@triton.jit
def _shared_rows(pid_m, routed_blocks, token_blocks, num_tokens, BLOCK_M: tl.constexpr):
    """(shared expert, token ids [BLOCK_M] int64, row mask) of a program past the routed blocks."""
    j = pid_m - routed_blocks
    token = (j % token_blocks) * BLOCK_M + tl.arange(0, BLOCK_M)
    return j // token_blocks, token.to(tl.int64), token < num_tokens


@triton.jit
def shared_gate_up(pid_m, offs_n, col_ok, x_ptr, h_ptr, gate_ptr, up_ptr, num_pairs, num_tokens, hidden, inter,
                   routed_blocks, token_blocks, stride_xt, stride_hp, stride_shared,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   DOT_F32: tl.constexpr, PRECISION: tl.constexpr):
    """A shared-expert program of a gate_up kernel: h rows P + s * T + t for its BLOCK_M tokens t,
    columns offs_n [BLOCK_N], from the shared MLP's gate and up weights read in place."""
    offs_k = tl.arange(0, BLOCK_K)
    shared, token, row_ok = _shared_rows(pid_m, routed_blocks, token_blocks, num_tokens, BLOCK_M)
    w_offs = (shared * inter + offs_n)[None, :].to(tl.int64) * stride_shared + offs_k[:, None]
    h = _swiglu_tile(x_ptr + token[:, None] * stride_xt + offs_k[None, :], gate_ptr + w_offs, up_ptr + w_offs, BLOCK_K,
                     row_ok, col_ok, hidden, BLOCK_M, BLOCK_N, BLOCK_K, DOT_F32, PRECISION)
    row = num_pairs + shared * num_tokens + token
    tl.store(h_ptr + row[:, None] * stride_hp + offs_n[None, :], h.to(h_ptr.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def shared_down(pid_m, offs_n, col_ok, h_ptr, y_ptr, down_ptr, num_pairs, num_tokens, inter, routed_blocks,
                token_blocks, stride_hp, stride_yp, stride_shared, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_K: tl.constexpr, DOT_F32: tl.constexpr, PRECISION: tl.constexpr):
    """A shared-expert program of a down kernel: y rows P + s * T + t (weight 1), columns offs_n."""
    offs_k = tl.arange(0, BLOCK_K)
    shared, token, row_ok = _shared_rows(pid_m, routed_blocks, token_blocks, num_tokens, BLOCK_M)
    row = num_pairs + shared * num_tokens + token
    # The shared down weight is [hidden, S * inter]: expert s's columns s * inter .. + inter - 1.
    w_ptrs = down_ptr + offs_n[None, :].to(tl.int64) * stride_shared + shared * inter + offs_k[:, None]
    acc = matmul_tile(h_ptr + row[:, None] * stride_hp + offs_k[None, :], w_ptrs, BLOCK_K, BLOCK_K,
                      row_ok, col_ok, inter, BLOCK_M, BLOCK_N, BLOCK_K, DOT_F32, PRECISION)
    tl.store(y_ptr + row[:, None] * stride_yp + offs_n[None, :], acc, mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def gate_up_kernel(
    x_ptr, w_ptr, sorted_pairs_ptr, block_expert_ptr, h_ptr, shared_gate_ptr, shared_up_ptr, scale_ptr,
    num_pairs, num_experts, num_tokens, top_k, hidden, inter, routed_blocks, token_blocks,
    stride_xt, stride_we, stride_wk, stride_hp, stride_shared, stride_se, stride_sn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_F32: tl.constexpr, PRECISION: tl.constexpr, DIRECT: tl.constexpr, PDL: tl.constexpr,
    W4: tl.constexpr = False, GROUP: tl.constexpr = 32, EVEN_K: tl.constexpr = False,
    UNPACK: tl.constexpr = "word", SCALE_PAIRS: tl.constexpr = False, STEP: tl.constexpr = 256,
):
    """h[row] = silu(x[t] @ Wg) * (x[t] @ Wu) per routed pair (row p) and per shared (s, t).
    W4: w_ptr is the packed int32 [E, 2 * inter, hidden / 8] (stride_we per expert, stride_wk per
    row), scale_ptr its scales (stride_se, stride_sn); EVEN_K: hidden and inter are multiples of BLOCK_K;
    UNPACK and SCALE_PAIRS: how the tiles unpack and load their scales (int4_tiles.int4_tile), or
    UNPACK "interleaved" / "interleaved_plain": weights in that order (int4_interleaved.py: no BLOCK_K,
    STEP columns a K step)."""
    wait_for_producers(PDL)
    pid_m = tl.program_id(0)  # fastest: the blocks of one expert share a weight tile in L2
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = offs_n < inter
    offs_k = tl.arange(0, BLOCK_K)
    if pid_m < routed_blocks:
        expert, pair = routed_block(pid_m, sorted_pairs_ptr, block_expert_ptr, num_pairs, num_experts, BLOCK_M, DIRECT)
        if expert >= 0:  # NO_EXPERT (-1): past the used blocks
            row_ok = pair < num_pairs  # padding slots hold num_pairs
            token = (pair // top_k).to(tl.int64)
            x_ptrs = x_ptr + token[:, None] * stride_xt + offs_k[None, :]
            if UNPACK == "interleaved" or UNPACK == "interleaved_plain":
                e = expert.to(tl.int64)
                h = swiglu_tile_w4i(x_ptr + token * stride_xt, row_ok, w_ptr + e * stride_we, scale_ptr + e * stride_se,
                                    offs_n, col_ok, inter, hidden, stride_wk, stride_sn, BLOCK_M, BLOCK_N, DOT_F32,
                                    UNPACK == "interleaved", STEP)
            elif W4:
                e = expert.to(tl.int64)
                h = _swiglu_tile_w4(x_ptrs, w_ptr + e * stride_we, scale_ptr + e * stride_se, offs_n, inter, row_ok,
                                    col_ok, hidden, stride_wk, stride_sn, x_ptr.dtype.element_ty, BLOCK_M, BLOCK_N,
                                    BLOCK_K, GROUP, EVEN_K, DOT_F32, PRECISION, UNPACK, SCALE_PAIRS)
            else:
                gate_ptrs = w_ptr + expert.to(tl.int64) * stride_we + offs_k[:, None] * stride_wk + offs_n[None, :]
                h = _swiglu_tile(x_ptrs, gate_ptrs, gate_ptrs + inter, BLOCK_K * stride_wk, row_ok, col_ok, hidden,
                                 BLOCK_M, BLOCK_N, BLOCK_K, DOT_F32, PRECISION)
            h_ptrs = h_ptr + pair.to(tl.int64)[:, None] * stride_hp + offs_n[None, :]
            tl.store(h_ptrs, h.to(h_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])
    else:
        shared_gate_up(pid_m, offs_n, col_ok, x_ptr, h_ptr, shared_gate_ptr, shared_up_ptr, num_pairs, num_tokens, hidden,
                       inter, routed_blocks, token_blocks, stride_xt, stride_hp, stride_shared,
                       BLOCK_M, BLOCK_N, BLOCK_K, DOT_F32, PRECISION)


@triton.jit
def down_kernel(
    h_ptr, w_ptr, weights_ptr, sorted_pairs_ptr, block_expert_ptr, y_ptr, shared_down_ptr, scale_ptr,
    num_pairs, num_experts, num_tokens, inter, hidden, routed_blocks, token_blocks,
    stride_hp, stride_we, stride_wk, stride_yp, stride_shared, stride_se, stride_sn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_F32: tl.constexpr, PRECISION: tl.constexpr, DIRECT: tl.constexpr, PDL: tl.constexpr,
    W4: tl.constexpr = False, GROUP: tl.constexpr = 32, EVEN_K: tl.constexpr = False,
    UNPACK: tl.constexpr = "word", SCALE_PAIRS: tl.constexpr = False, STEP: tl.constexpr = 256,
):
    """y[row] = weight * (h[row] @ Wd), float32: the router's weight per routed pair, 1 for shared.
    W4: w_ptr is the packed int32 [E, hidden, inter / 8], scale_ptr its scales (as gate_up_kernel)."""
    wait_for_producers(PDL)
    pid_m = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = offs_n < hidden
    offs_k = tl.arange(0, BLOCK_K)
    if pid_m < routed_blocks:
        expert, pair = routed_block(pid_m, sorted_pairs_ptr, block_expert_ptr, num_pairs, num_experts, BLOCK_M, DIRECT)
        if expert >= 0:
            row_ok = pair < num_pairs
            row = tl.where(row_ok, pair, 0).to(tl.int64)
            h_ptrs = h_ptr + row[:, None] * stride_hp + offs_k[None, :]
            if UNPACK == "interleaved" or UNPACK == "interleaved_plain":
                e = expert.to(tl.int64)
                acc = matmul_tile_w4i(h_ptr + row * stride_hp, row_ok, w_ptr + e * stride_we, scale_ptr + e * stride_se,
                                      offs_n, col_ok, inter, stride_wk, stride_sn, BLOCK_M, BLOCK_N, DOT_F32,
                                      UNPACK == "interleaved", STEP)
            elif W4:
                e = expert.to(tl.int64)
                acc = _matmul_tile_w4(h_ptrs, w_ptr + e * stride_we, scale_ptr + e * stride_se, offs_n, row_ok, col_ok,
                                      inter, stride_wk, stride_sn, h_ptr.dtype.element_ty, BLOCK_M, BLOCK_N, BLOCK_K,
                                      GROUP, EVEN_K, DOT_F32, PRECISION, UNPACK, SCALE_PAIRS)
            else:
                w_ptrs = w_ptr + expert.to(tl.int64) * stride_we + offs_k[:, None] * stride_wk + offs_n[None, :]
                acc = matmul_tile(h_ptrs, w_ptrs, BLOCK_K, BLOCK_K * stride_wk, row_ok, col_ok, inter,
                                  BLOCK_M, BLOCK_N, BLOCK_K, DOT_F32, PRECISION)
            weight = tl.load(weights_ptr + row, mask=row_ok, other=0.0)
            tl.store(y_ptr + row[:, None] * stride_yp + offs_n[None, :], acc * weight[:, None],
                     mask=row_ok[:, None] & col_ok[None, :])
    else:
        shared_down(pid_m, offs_n, col_ok, h_ptr, y_ptr, shared_down_ptr, num_pairs, num_tokens, inter, routed_blocks,
                    token_blocks, stride_hp, stride_yp, stride_shared, BLOCK_M, BLOCK_N, BLOCK_K, DOT_F32, PRECISION)


@triton.jit
def sum_choices_kernel(y_ptr, ids_ptr, out_ptr, hidden, num_pairs, num_tokens, num_experts,
                       TOP_K: tl.constexpr, SHARED: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """out[t] = y[t, 0] + ... + y[t, k-1] (+ the S shared rows of t), float32 in that order (the
    same bits in every run and graph replay), rounded to out's dtype; a choice whose expert id is
    outside [0, num_experts) (dropped: another rank's expert) adds nothing."""
    wait_for_producers(PDL)
    token = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < hidden
    acc = tl.zeros(offs.shape, tl.float32)
    for j in tl.static_range(TOP_K):
        expert = tl.load(ids_ptr + token * TOP_K + j)
        mine = (expert >= 0) & (expert < num_experts)
        acc += tl.load(y_ptr + (token * TOP_K + j) * hidden + offs, mask=ok & mine, other=0.0)
    for s in tl.static_range(SHARED):
        acc += tl.load(y_ptr + (num_pairs + s * num_tokens + token) * hidden + offs, mask=ok, other=0.0)
    tl.store(out_ptr + token * hidden + offs, acc.to(out_ptr.dtype.element_ty), mask=ok)
