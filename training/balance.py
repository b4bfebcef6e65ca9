"""DeepSeek-V3's auxiliary-loss-free load balancing for the noaux_tc router, as a training helper.

The router's correction bias enters only the expert choice (a top-k), so it gets no gradient: after
each step it moves by rate * sign(mean load - load), raising under-loaded experts and lowering
over-loaded ones. The bias is kept in float32 here and copied into the (bf16) model, whose
spacing near 0.5 (2^-9) is wider than a 1e-3 step.
"""

from __future__ import annotations

import torch

from ddtree.models import Target
from ddtree.models.layers import MoE


class RouterBalance:
    """Counts each MoE layer's expert choices during a step; update() applies the bias step.

    Construct it before the optimizer: it takes the biases out of autograd (requires_grad False),
    so an optimizer built from requires_grad parameters never steps or overwrites them."""

    def __init__(self, model: Target, rate: float):
        self.rate = rate
        self.moes = [layer.mlp for layer in model.layers if isinstance(layer.mlp, MoE)]
        self.bias = []
        for moe in self.moes:
            param = moe.gate.e_score_correction_bias
            if param is None:
                raise ValueError("RouterBalance needs the noaux_tc router's e_score_correction_bias")
            param.requires_grad_(False)
            self.bias.append(param.detach().float().clone())
        self.loads: list[torch.Tensor | None] = [None] * len(self.moes)
        for i, moe in enumerate(self.moes):
            moe.gate.register_forward_hook(self._hook(i))

    def _hook(self, i):
        def record(module, inputs, output):
            counts = torch.bincount(output[1].flatten(), minlength=module.weight.shape[0]).float()
            self.loads[i] = counts if self.loads[i] is None else self.loads[i] + counts
        return record

    def reset(self) -> None:
        """Forget the loads counted since the last update (e.g. an evaluation's)."""
        self.loads = [None] * len(self.moes)

    @torch.no_grad()
    def update(self) -> float:
        """Apply the bias step from this step's loads; returns the worst layer's max / mean load."""
        worst = 1.0
        for moe, bias, load in zip(self.moes, self.bias, self.loads):
            if load is None:
                continue
            mean = load.mean()
            bias += self.rate * torch.sign(mean - load)
            moe.gate.e_score_correction_bias.copy_(bias)
            worst = max(worst, float(load.max() / mean))
        self.reset()
        return worst
