"""Expert alignment for the fused MoE kernel: (token, choice) pairs grouped by expert, in blocks.

The routed-expert GEMMs run one program per block of BLOCK_M pairs that all go to the same expert,
so each program reads one expert's weight tile for all its rows. One program of `_align_kernel`
sorts the pairs by expert on the device and pads each expert's run to a whole number of blocks.
Output sizes depend on (pairs, experts, BLOCK_M) only: no host sync, so a CUDA graph can capture it.

Layout of the result, for pairs p = token * k + choice, p < P = T * k:

    sorted_pairs  int32 [max_blocks * BLOCK_M]: expert 0's pairs (ascending p), padded with P
                  (past every real pair: the padding sentinel) up to a multiple of BLOCK_M, then
                  expert 1's, ...; the slots of the blocks past the used ones also hold P.
    block_expert  int32 [max_blocks]: the expert of each block; NO_EXPERT (-1) past the used blocks,
                  where the GEMM programs exit at once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .launch import launch_flags, wait_for_producers

NO_EXPERT = -1  # block_expert of a block past the used ones
MAX_PAIRS = 8192  # one program sorts all pairs in registers: the fused path is for few rows
MAX_EXPERTS = 1024  # with MAX_PAIRS, sort keys expert * P_PAD + p stay in int32


def token_chunks(num_tokens: int, top_k: int) -> list[slice]:
    """The token ranges, in order, whose (token, choice) pairs the alignment takes at once
    (at most MAX_PAIRS each): how many tokens one fused_moe call may be given."""
    chunk = max(1, MAX_PAIRS // max(1, top_k))
    return [slice(t, min(t + chunk, num_tokens)) for t in range(0, num_tokens, chunk)]
_NO_EXPERT: tl.constexpr = tl.constexpr(NO_EXPERT)  # the kernel's copy


def max_blocks(num_pairs: int, num_experts: int, block_m: int) -> int:
    """A static bound on the blocks the alignment fills. An expert with c pairs fills ceil(c / M)
    <= (c + M - 1) / M blocks, at most min(P, E) experts get any pair, and the counts sum to P:
    blocks <= (P + min(P, E) * (M - 1)) / M. The bound is reached (every used expert one pair past
    a block boundary), so it is the tightest bound from (P, E, M) alone."""
    return (num_pairs + min(num_pairs, num_experts) * (block_m - 1)) // block_m


@dataclass
class ExpertBlocks:
    """Pairs grouped by expert in blocks of block_m (the module docstring spells out the layout)."""

    sorted_pairs: torch.Tensor  # int32 [max_blocks * block_m]
    block_expert: torch.Tensor  # int32 [max_blocks]
    num_pairs: int  # P = T * k, also the padding value in sorted_pairs
    block_m: int


@triton.jit
def _align_kernel(
    ids_ptr, sorted_pairs_ptr, block_expert_ptr,
    num_pairs, num_experts, num_blocks,
    P_PAD: tl.constexpr, E_PAD: tl.constexpr, BLOCK_M: tl.constexpr, CHUNK: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_producers(PDL)
    p = tl.arange(0, P_PAD)
    expert = tl.load(ids_ptr + p, mask=p < num_pairs, other=-1)
    valid = (p < num_pairs) & (expert >= 0) & (expert < num_experts)  # out-of-range ids are dropped
    expert = tl.where(valid, expert, E_PAD).to(tl.int32)

    counts = tl.histogram(tl.where(valid, expert, 0), E_PAD, mask=valid)  # [E_PAD] pairs per expert
    blocks = tl.cdiv(counts, BLOCK_M)
    block_start = tl.cumsum(blocks, 0) - blocks
    count_start = tl.cumsum(counts, 0) - counts

    # Sorting the keys (expert, p) orders pairs by expert, ascending p within one expert; dropped
    # pairs (expert E_PAD) sort last. Position i in that order is count_start[e] + rank in e.
    key = tl.sort(expert * P_PAD + p)
    e_i = key // P_PAD
    pair = key % P_PAD
    kept = e_i < E_PAD
    e_safe = tl.where(kept, e_i, 0)
    rank = p - tl.gather(count_start, e_safe, 0)
    slot = tl.gather(block_start, e_safe, 0) * BLOCK_M + rank
    tl.store(sorted_pairs_ptr + slot, pair, mask=kept)
    tl.store(block_expert_ptr + slot // BLOCK_M, e_i, mask=kept & (rank % BLOCK_M == 0))

    # The tail of each expert's last block: slots count .. blocks * BLOCK_M - 1 of its run.
    j = tl.arange(0, BLOCK_M)
    tail = (block_start * BLOCK_M + counts)[:, None] + j[None, :]
    tl.store(sorted_pairs_ptr + tail, num_pairs, mask=(counts[:, None] + j[None, :]) < (blocks * BLOCK_M)[:, None])

    # Blocks past the used ones: no expert, every slot padding.
    used = tl.sum(blocks, 0)
    for b0 in range(0, num_blocks, CHUNK):
        b = b0 + tl.arange(0, CHUNK)
        unused = (b >= used) & (b < num_blocks)
        tl.store(block_expert_ptr + b, _NO_EXPERT, mask=unused)
        tl.store(sorted_pairs_ptr + b[:, None] * BLOCK_M + j[None, :], num_pairs, mask=unused[:, None])


def align_warps(p_pad: int) -> int:
    """Warps of the one alignment program for P_PAD pairs: it runs alone on one multiprocessor and
    its sort's instructions per thread fall with the warps that share it, so the wide sorts (a
    tree verify's hundreds of rows) take 16 (tests/ops/test_fused_moe_compile.py compares them)."""
    return 4 if p_pad <= 256 else 8 if p_pad <= 1024 else 16


def align_by_expert(ids: torch.Tensor, num_experts: int, block_m: int,
                    out: tuple[torch.Tensor, torch.Tensor] | None = None, pdl: bool = True) -> ExpertBlocks:
    """ids int64 [T, k] (expert of each (token, choice), each in [0, num_experts): ids outside are
    dropped, their pairs in no block) -> ExpertBlocks. `out`: optional (sorted_pairs, block_expert)
    buffers of the documented shapes, written in full; pdl: ops/launch.py. The caller validates
    ids' device and dtype."""
    num_pairs = ids.numel()
    if num_pairs > MAX_PAIRS:
        raise ValueError(f"ids has {num_pairs} (token, choice) pairs, the fused MoE path takes at most {MAX_PAIRS}")
    if not 1 <= num_experts <= MAX_EXPERTS:
        raise ValueError(f"num_experts must be in [1, {MAX_EXPERTS}], got {num_experts}")
    if block_m < 1 or block_m & (block_m - 1):
        raise ValueError(f"block_m must be a power of two, got {block_m}")
    n_blocks = max_blocks(num_pairs, num_experts, block_m)
    if out is None:
        out = (torch.empty(n_blocks * block_m, dtype=torch.int32, device=ids.device),
               torch.empty(n_blocks, dtype=torch.int32, device=ids.device))
    sorted_pairs, block_expert = out
    for name, t, n in (("sorted_pairs", sorted_pairs, n_blocks * block_m), ("block_expert", block_expert, n_blocks)):
        if t.shape != (n,) or t.dtype != torch.int32 or t.device != ids.device:
            raise ValueError(f"out {name} must be int32 [{n}] on {ids.device}, got {t.dtype} {list(t.shape)} on {t.device}")
    if n_blocks:
        p_pad = triton.next_power_of_2(max(num_pairs, 16))
        _align_kernel[(1,)](
            ids, sorted_pairs, block_expert, num_pairs, num_experts, n_blocks,
            P_PAD=p_pad, E_PAD=triton.next_power_of_2(max(num_experts, 16)),
            BLOCK_M=block_m, CHUNK=64, num_warps=align_warps(p_pad),  # CHUNK: unused blocks marked per loop step
            **launch_flags(ids.device, pdl),
        )
    return ExpertBlocks(sorted_pairs, block_expert, num_pairs, block_m)
