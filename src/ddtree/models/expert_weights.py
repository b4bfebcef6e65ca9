"""The routed experts between a checkpoint and the MoE's stacked storage, both ways.

A checkpoint stores each expert's Linears apart: `model.layers.{i}.mlp.experts.{e}.{proj}.weight`
([out, in], 16-bit), or for INT4 experts (models/quant.py) `{proj}.weight_packed`,
`{proj}.weight_scale` and `{proj}.weight_shape`; proj is gate_proj, up_proj or down_proj. The MoE
stacks them per layer (layers.MoE): 16-bit transposed into w_gate_up / w_down, INT4 as stored, gate
rows then up rows.
"""

from __future__ import annotations

import re

import torch

from ..ops.int4 import reordered_words
from .config import TargetConfig
from .layers import MoE

EXPERT_TENSOR = re.compile(r"layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\."
                           r"(weight|weight_packed|weight_scale|weight_shape)")
PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


def stored_as(cfg: TargetConfig) -> tuple[str, ...]:
    """The tensors a checkpoint holds per expert Linear."""
    return ("weight",) if cfg.int4_experts is None else ("weight_packed", "weight_scale", "weight_shape")


def expected_names(cfg: TargetConfig, experts: range | None = None) -> set[str]:
    """Every routed-expert tensor name (`model.` prefix) a checkpoint of `cfg` must hold for the
    experts `experts` (default: all; a rank of an expert-parallel target: its own)."""
    experts = range(cfg.n_routed_experts) if experts is None else experts
    return {f"model.layers.{i}.mlp.experts.{e}.{p}.{kind}"
            for i in range(cfg.num_hidden_layers) if cfg.is_moe_layer(i)
            for e in experts for p in PROJECTIONS for kind in stored_as(cfg)}


def _layout(cfg: TargetConfig, proj: str) -> tuple[str, slice, tuple[int, int]]:
    """(the MoE's stack that holds `proj`, its rows there (the last dimension of a 16-bit stack,
    which is stored transposed), the Linear's (out, in))."""
    h, inter = cfg.hidden_size, cfg.moe_intermediate_size
    if proj == "down_proj":
        return "w_down", slice(0, h), (h, inter)
    return "w_gate_up", slice(0, inter) if proj == "gate_proj" else slice(inter, 2 * inter), (inter, h)


def place(moe: MoE, cfg: TargetConfig, name: str, match: re.Match, tensor: torch.Tensor) -> None:
    """Copy checkpoint tensor `name` (matched by EXPERT_TENSOR) into `moe` (which holds the experts
    moe.local of them); raises naming it."""
    e, proj, kind = int(match[2]), match[3], match[4]
    if e >= cfg.n_routed_experts:
        raise ValueError(f"unexpected checkpoint tensor {name} (the layer has {cfg.n_routed_experts} routed experts)")
    if not moe.local.start <= e < moe.local.stop:
        raise ValueError(f"checkpoint tensor {name}: expert {e} is not this rank's ({moe.local.start} .. {moe.local.stop - 1})")
    e -= moe.local.start
    if kind not in stored_as(cfg):
        how = "16-bit" if cfg.int4_experts is None else f"INT4 (group {cfg.int4_experts.group_size})"
        raise ValueError(f"checkpoint tensor {name}: config.json's quantization_config says the routed experts are "
                         f"{how}, which stores no {kind}")
    stack, rows, (out, in_) = _layout(cfg, proj)
    if kind == "weight_shape":
        if tensor.tolist() != [out, in_]:
            raise ValueError(f"checkpoint tensor {name} says the weight is {tensor.tolist()}, expected {[out, in_]}")
        return
    if kind == "weight":
        _check_shape(name, tensor, (out, in_))
        getattr(moe, stack).data[e][:, rows].copy_(tensor.T)
        return
    part = "packed" if kind == "weight_packed" else "scale"
    if part == "packed" and tensor.dtype != torch.int32:
        raise ValueError(f"checkpoint tensor {name} is {tensor.dtype}, expected int32 (packed INT4)")
    _check_shape(name, tensor, (out, in_ // 8 if part == "packed" else in_ // cfg.int4_experts.group_size))
    getattr(moe, f"{stack}_{part}").data[e, rows].copy_(tensor)


def _check_shape(name: str, tensor: torch.Tensor, shape: tuple[int, int]) -> None:
    if tuple(tensor.shape) != shape:
        raise ValueError(f"checkpoint tensor {name} has shape {tuple(tensor.shape)}, expected {shape}")


def checkpoint_tensors_of(moe: MoE, layer: int, cfg: TargetConfig) -> dict[str, torch.Tensor]:
    """The routed experts of `moe` (layer `layer`) under their checkpoint names: the inverse of place
    (INT4 words in compressed-tensors' order, also from experts interleaved on a GPU)."""
    out = {}
    for e in range(cfg.n_routed_experts):
        for proj in PROJECTIONS:
            name = f"model.layers.{layer}.mlp.experts.{e}.{proj}."
            stack, rows, shape = _layout(cfg, proj)
            if cfg.int4_experts is None:
                out[name + "weight"] = getattr(moe, stack)[e].detach()[:, rows].T
                continue
            words = getattr(moe, stack + "_packed")[e, rows].detach()
            if moe.int4_interleaved:  # a GPU's order: the checkpoint holds compressed-tensors'
                words = reordered_words(words, to_interleaved=False)
            out[name + "weight_packed"] = words
            out[name + "weight_scale"] = getattr(moe, stack + "_scale")[e, rows].detach()
            out[name + "weight_shape"] = torch.tensor(shape)
    return out
