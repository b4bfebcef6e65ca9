"""Compile the decode step's small PDL kernels for sm_90 without a GPU (see fused_moe_compile.py):
the norm (with a residual), MLA's rotary and cache-entry
kernels, and the attention's split merge, at Moonlight's widths; the drafter's query / key norm,
rope and cache writes, and the top-k's two launches at a budget of 16. Run without TRITON_INTERPRET."""

from __future__ import annotations

from ddtree.attention import tree_verify
from ddtree.ops import mla as fused_mla
from ddtree.ops import norm as fused_norm
from ddtree.ops import drafter_qkv
from ddtree.tree import topk_triton

from .fused_moe_compile import compile_report

BF16 = "*bf16"


def all_reports() -> dict[str, dict]:
    norm = dict(x_ptr=BF16, delta_ptr=BF16, w_ptr=BF16, out_ptr=BF16, sum_ptr=BF16, eps="fp32")
    rope = dict(x_ptr=BF16, cos_ptr=BF16, sin_ptr=BF16, out_ptr=BF16)
    entry = dict(kv_ptr=BF16, w_ptr=BF16, cos_ptr=BF16, sin_ptr=BF16, slot_ptr="*i64", cache_ptr=BF16, eps="fp32")
    merge = dict(part_ptr="*fp32", part_lse_ptr="*fp32", out_ptr=BF16, lse_ptr="*fp32")
    qkv = dict(x_ptr=BF16, wq_ptr=BF16, wk_ptr=BF16, cos_ptr=BF16, sin_ptr=BF16, q_ptr=BF16, k_cache_ptr=BF16,
               v_cache_ptr=BF16, rows_ptr="*i64", slots_ptr="*i64", eps="fp32")
    chunks = dict(x_ptr=BF16, keys_ptr="*i64", m_ptr="*fp32", s_ptr="*fp32")
    best = dict(keys_ptr="*i64", m_ptr="*fp32", s_ptr="*fp32", lp_ptr="*fp32", tok_ptr="*i64")
    return {
        "rms_norm_delta": compile_report(fused_norm._rms_norm_kernel, norm, dict(HAS_DELTA=True, BLOCK=2048),
                                         num_warps=4),
        "rotary": compile_report(fused_mla._rotary_kernel, rope, dict(HALF=32, BLOCK_HALF=32, INTERLEAVE=True),
                                 num_warps=1),
        "latent_entry": compile_report(fused_mla._latent_entry_kernel, entry,
                                       dict(HALF=32, BLOCK_C=512, BLOCK_HALF=32, INTERLEAVE=True),
                                       num_warps=fused_mla.ENTRY_WARPS),
        "merge_splits": compile_report(tree_verify.merge_splits_kernel, merge,
                                       dict(D_V=512, SPLITS=32, BLOCK_V=128), num_warps=4),
        "drafter_qkv": compile_report(drafter_qkv._drafter_qkv_kernel, qkv,
                                      dict(HALF=64, BLOCK_H=drafter_qkv.HEADS_PER_PROGRAM), num_warps=1),
        "topk_chunks": compile_report(topk_triton._chunk_kernel, chunks, dict(CHUNK=4096, GROUPS=64, KPAD=16, CAP=64),
                                      num_warps=8, not_divisible=("chunks",)),
        "topk_merge": compile_report(topk_triton._merge_kernel, best, dict(KPAD=16, CAP=64, GROUP=64, CPAD=64),
                                     num_warps=8, not_divisible=("chunks", "k")),
    }
