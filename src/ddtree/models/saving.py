"""Write a Target or Drafter as a Hugging Face-style checkpoint directory (the inverse of loader.py).

Targets are written with DeepseekV3's tensor names (routed experts as one gate / up / down tensor
each, `model.` prefix), so transformers' DeepseekV3ForCausalLM reads the same directory. Shards
stay under max_shard_bytes, with a model.safetensors.index.json when there is more than one.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from .drafter import Drafter
from .moe import MoE
from .target import Target


def target_tensors(model: Target) -> dict[str, torch.Tensor]:
    """Every tensor of the target under its DeepseekV3 checkpoint name; tied lm_head omitted."""
    cfg = model.cfg
    out: dict[str, torch.Tensor] = {}
    for name, param in model.named_parameters():
        if name.endswith((".w_gate_up", ".w_down")):
            continue
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            raise ValueError("the config ties lm_head to embed_tokens but the model's lm_head is a separate tensor")
        out[name if name == "lm_head.weight" else f"model.{name}"] = param.detach()
    if not cfg.tie_word_embeddings and "lm_head.weight" not in out:  # a tied module that the config calls untied
        out["lm_head.weight"] = model.lm_head.weight.detach()
    inter = cfg.moe_intermediate_size
    for i, layer in enumerate(model.layers):
        if not isinstance(layer.mlp, MoE):
            continue
        for e in range(cfg.n_routed_experts):
            prefix = f"model.layers.{i}.mlp.experts.{e}."
            w_gate_up, w_down = layer.mlp.w_gate_up[e].detach(), layer.mlp.w_down[e].detach()
            out[prefix + "gate_proj.weight"] = w_gate_up[:, :inter].T
            out[prefix + "up_proj.weight"] = w_gate_up[:, inter:].T
            out[prefix + "down_proj.weight"] = w_down.T
    return out


def write_shards(tensors: dict[str, torch.Tensor], path: str | Path, dtype: torch.dtype, max_shard_bytes: int) -> list[str]:
    """Save tensors (cast to dtype, on the CPU) as safetensors shards of at most max_shard_bytes,
    replacing any earlier weights in path; returns the shard file names. One shard is
    model.safetensors, several get an index."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    # An earlier save's shards or index would be read instead of (or mixed with) these weights.
    for old in [*path.glob("model*.safetensors"), path / "model.safetensors.index.json"]:
        old.unlink(missing_ok=True)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name in sorted(tensors):
        t = tensors[name].to("cpu", dtype).contiguous().clone()
        nbytes = t.numel() * t.element_size()
        if nbytes > max_shard_bytes:
            raise ValueError(f"tensor {name} ({nbytes} bytes) is larger than max_shard_bytes={max_shard_bytes}")
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    if len(shards) == 1:
        names = ["model.safetensors"]
    else:
        names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
        weight_map = {n: file for file, shard in zip(names, shards) for n in shard}
        total = sum(t.numel() * t.element_size() for shard in shards for t in shard.values())
        (path / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    for file, shard in zip(names, shards):
        save_file(shard, str(path / file), metadata={"format": "pt"})
    return names


def save_target(model: Target, config: dict, path: str | Path, *, dtype: torch.dtype = torch.bfloat16,
                max_shard_bytes: int = 15 << 20) -> None:
    """Write config.json (the given Hugging Face config dict) and the weights in dtype."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    write_shards(target_tensors(model), path, dtype, max_shard_bytes)


def save_drafter(model: Drafter, config: dict, path: str | Path, *, dtype: torch.dtype = torch.bfloat16,
                 max_shard_bytes: int = 15 << 20) -> None:
    """Write a DFlash drafter: config.json and its own weights (embeddings and lm_head are the target's)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    write_shards({n: p.detach() for n, p in model.named_parameters()}, path, dtype, max_shard_bytes)
