"""A training form of the MoE layer: every routed expert runs on every token, and the router's
weights (zero for the experts not chosen) combine them. The same function as MoE.forward (the
grouped-GEMM path the engine serves), with no data-dependent shapes, so its backward is plain
batched matmuls. At the demo's size (8 experts of width 64) this costs as much as one 512-wide MLP.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ddtree.models.layers import MoE


def dense_moe_forward(self: MoE, x: torch.Tensor, router_ids: list[torch.Tensor] | None = None) -> torch.Tensor:
    """x [..., hidden] -> [..., hidden], as MoE.forward."""
    shape = x.shape
    x = x.reshape(-1, shape[-1])
    weights, ids = self.gate(x)  # float32 [T, k], int64 [T, k]
    if router_ids is not None:
        router_ids.append(ids)
    per_expert = torch.zeros(x.shape[0], self.w_down.shape[0], dtype=weights.dtype, device=x.device)
    per_expert = per_expert.scatter(1, ids, weights)  # [T, E]
    gate, up = torch.matmul(x, self.w_gate_up).chunk(2, dim=-1)  # [E, T, inter] each
    routed = torch.bmm(F.silu(gate) * up, self.w_down)  # [E, T, hidden]
    out = (routed.float() * per_expert.T[..., None]).sum(0).to(x.dtype)
    if self.shared_experts is not None:
        out = out + self.shared_experts(x)
    return out.view(shape)


def use_dense_moe(model: torch.nn.Module) -> None:
    """Route every MoE layer of model through dense_moe_forward."""
    for module in model.modules():
        if isinstance(module, MoE):
            module.forward = dense_moe_forward.__get__(module, MoE)
