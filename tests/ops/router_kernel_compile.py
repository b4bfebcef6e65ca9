"""Compile the fused router for sm_90 without a GPU (see fused_moe_compile.py) at the shapes of the
routers it serves. Run without TRITON_INTERPRET."""

from __future__ import annotations

import triton

from ddtree.ops import router as router_kernel

from .fused_moe_compile import compile_report

# name: (top_k, n_group, topk_group, experts, scoring_func), as in the models' config.json
ROUTERS = {
    "deepseek_v3": (8, 8, 4, 256, "sigmoid"),  # noaux_tc, 8 groups of 32
    "kimi_k2": (8, 1, 1, 384, "sigmoid"),  # one group of 384 in 512 lanes
    "moonlight": (6, 1, 1, 64, "sigmoid"),
    "deepseek_v2_lite": (6, 1, 1, 64, "softmax"),  # greedy, no bias
}
POINTERS = dict(logits_ptr="*fp32", bias_ptr="*bf16", weights_ptr="*fp32", ids_ptr="*i64", scaling="fp32")


def all_reports() -> dict[str, dict]:
    reports = {}
    for name, (top_k, n_group, topk_group, experts, scoring) in ROUTERS.items():
        constants = dict(TOP_K=top_k, K_PAD=triton.next_power_of_2(top_k), TOPK_GROUP=topk_group, G_PAD=n_group,
                         S_PAD=triton.next_power_of_2(experts // n_group), SOFTMAX=scoring == "softmax",
                         HAS_BIAS=scoring == "sigmoid", GROUP_SCORE=int(n_group > 1), NORM=True, CUDA_EXP=True)
        reports[name] = compile_report(router_kernel._router_kernel, POINTERS, constants, router_kernel.NUM_WARPS,
                                       not_divisible=("n_group", "group_size", "stride_lt", "scaling"))
    return reports
