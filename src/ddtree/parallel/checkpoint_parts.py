"""The part of each checkpoint tensor a rank reads (parallel/shard.py's split), so that no process
reads the whole model: rows or columns of the head-split, column-split and vocabulary-split
weights, whole replicated ones, and only its own routed experts (expert_range)."""

from __future__ import annotations

import re

from .shard import Shard

_ATTENTION = re.compile(r"layers\.\d+\.self_attn\.(q_proj|q_b_proj|kv_b_proj|o_proj)\.weight")
_MLP = re.compile(r"layers\.(\d+)\.mlp\.(shared_experts\.)?(gate_proj|up_proj|down_proj)\.weight")


def expert_range(cfg, shard: Shard) -> range:
    """The routed experts (global ids) this rank holds."""
    part = shard.part(cfg.n_routed_experts, "n_routed_experts") if cfg.n_routed_experts else slice(0, 0)
    return range(part.start, part.stop)


def tensor_part(cfg, shard: Shard, key: str) -> tuple[slice, ...] | None:
    """The index of checkpoint tensor `key` (its name without `model.`) this rank reads, or None for
    the whole tensor (replicated, or one process). Routed experts are chosen by name instead
    (expert_range)."""
    if shard.world == 1:
        return None
    if key in ("embed_tokens.weight", "lm_head.weight"):
        return (shard.part(cfg.vocab_size, "vocab_size"),)
    attn = _ATTENTION.fullmatch(key)
    if attn:
        proj = attn[1]
        per_head = {"q_proj": cfg.qk_head_dim, "q_b_proj": cfg.qk_head_dim,
                    "kv_b_proj": cfg.qk_nope_head_dim + cfg.v_head_dim, "o_proj": cfg.v_head_dim}[proj]
        heads = shard.part(cfg.num_attention_heads, "attention heads")
        cut = slice(heads.start * per_head, heads.stop * per_head)
        return (slice(None), cut) if proj == "o_proj" else (cut,)
    mlp = _MLP.fullmatch(key)
    if mlp:
        inter = cfg.moe_intermediate_size * cfg.n_shared_experts if mlp[2] else cfg.intermediate_size
        cut = shard.part(inter, "an MLP's intermediate size")
        return (slice(None), cut) if mlp[3] == "down_proj" else (cut,)
    return None
