"""Compile the decode step's few-row GEMM kernels for sm_90 without a GPU (see fused_moe_compile.py)
at their default tiles, specialized as a decode step launches them (one row; unit strides as
Triton specializes them). Run without TRITON_INTERPRET."""

from __future__ import annotations

from ddtree.ops import gemm as skinny
from ddtree.ops import mla as absorbed_query

from .fused_moe_compile import compile_report

BF16 = "*bf16"


def all_reports() -> dict[str, dict]:
    """skinny at its three column blocks in nn.Linear layout (W^T: unit K stride), the per-head W_UK
    layout (unit N stride), and absorbed_query's kernel at Moonlight's MLA widths."""
    tiles = dict(BLOCK_M=skinny.BLOCK_M, BLOCK_K=skinny.BLOCK_K, DOT_F32=False, PRECISION="tf32", M=1)
    gemm = dict(num_warps=skinny.NUM_WARPS, num_stages=skinny.NUM_STAGES)
    pointers = dict(x_ptr=BF16, w_ptr=BF16, out_ptr=BF16)
    reports = {}
    for block_n in (16, 32, 64):
        linear = dict(stride_xk=1, stride_wk=1, stride_on=1)
        reports[f"linear_n{block_n}"] = compile_report(skinny._skinny_kernel, pointers,
                                                       dict(tiles, BLOCK_N=block_n, **linear), **gemm,
                                                       not_divisible=("N",))
    per_head = dict(stride_xk=1, stride_wn=1, stride_on=1)
    reports["per_head_n32"] = compile_report(skinny._skinny_kernel, pointers,
                                             dict(tiles, BLOCK_N=32, BLOCK_K=128, **per_head), **gemm)
    aq = dict(q_ptr=BF16, w_ptr=BF16, query_ptr=BF16, kv_ptr=BF16, norm_w_ptr=BF16, cos_ptr=BF16, sin_ptr=BF16,
              slot_ptr="*i64", cache_ptr=BF16, eps="fp32")
    reports["absorbed_query"] = compile_report(
        absorbed_query._absorbed_query_kernel, aq,
        dict(HALF=32, BLOCK_HALF=32, BLOCK_C=512, INTERLEAVE=True, BLOCK_M=skinny.BLOCK_M,
             BLOCK_N=absorbed_query.BLOCK_N, BLOCK_K=128, DOT_F32=False, PRECISION="tf32", rows=1),
        **gemm, not_divisible=("heads", "nope", "n_tiles"))
    return reports
