"""The routed experts through two grouped GEMMs (torch._grouped_mm): fused_moe's reference
(ops/moe.py) and the path for many rows and for autograd."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .int4 import PackedInt4, dequantize_int4


def expert_shape(w_gate_up: torch.Tensor | PackedInt4) -> tuple[int, int, int]:
    """(E, hidden, inter) of the routed experts, 16-bit [E, hidden, 2 * inter] or INT4 [E, 2 * inter, hidden]."""
    if isinstance(w_gate_up, PackedInt4):
        return w_gate_up.packed.shape[0], w_gate_up.in_features, w_gate_up.out_features // 2
    return w_gate_up.shape[0], w_gate_up.shape[1], w_gate_up.shape[2] // 2


def grouped_moe(x: torch.Tensor, w_gate_up: torch.Tensor | PackedInt4, w_down: torch.Tensor | PackedInt4,
                weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The routed experts' sum through two grouped GEMMs: fused_moe's reference (without shared
    experts), and the path for many rows and for autograd. Tensors as fused_moe's (x [T, hidden];
    any device torch._grouped_mm runs on). Pairs are sorted by expert (no per-token or per-expert
    Python loop, no host sync: expert offsets stay on the device); the k choices are summed in
    float32 in choice order, deterministic unlike an atomic index_add_. A pair whose id is outside
    [0, E) (another rank's expert) adds nothing, as in fused_moe. INT4 experts: the experts the
    tokens chose are dequantized first (int4.dequantize_int4), which reads the ids back."""
    dropped = (ids < 0) | (ids >= expert_shape(w_gate_up)[0])  # another rank's experts (expert parallel)
    ids = ids.masked_fill(dropped, 0)
    if isinstance(w_gate_up, PackedInt4):
        w_gate_up, w_down, ids = _dequantized_experts(x.dtype, w_gate_up, w_down, ids)
    k = ids.shape[1]
    flat = ids.flatten()
    order = flat.argsort(stable=True)
    token = order // k
    counts = torch.zeros(w_down.shape[0], dtype=torch.int32, device=x.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
    offsets = counts.cumsum(0, dtype=torch.int32)
    gate, up = torch._grouped_mm(x[token], w_gate_up, offs=offsets).chunk(2, dim=-1)
    routed = torch._grouped_mm(F.silu(gate) * up, w_down, offs=offsets)
    per_choice = torch.empty_like(routed)
    per_choice[order] = routed
    per_choice = per_choice.view(-1, k, routed.shape[-1]).float() * weights[..., None]
    return torch.where(dropped[..., None], 0.0, per_choice).sum(1).to(x.dtype)


def _dequantized_experts(dtype: torch.dtype, w_gate_up: PackedInt4, w_down: PackedInt4, ids: torch.Tensor):
    """(w_gate_up [U, hidden, 2 * inter], w_down [U, inter, hidden] in dtype, ids renumbered) for the U
    experts in ids, in grouped_moe's layout."""
    used, local = ids.unique(return_inverse=True)
    pick = lambda w: PackedInt4(w.packed[used], w.scale[used], w.group_size, w.interleaved)  # noqa: E731
    gate_up = dequantize_int4(pick(w_gate_up), dtype).transpose(1, 2).contiguous()
    down = dequantize_int4(pick(w_down), dtype).transpose(1, 2).contiguous()
    return gate_up, down, local.view_as(ids)
