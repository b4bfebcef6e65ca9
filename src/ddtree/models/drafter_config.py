"""A DFlash drafter's configuration (its config.json: a Qwen3-style stack plus dflash_config) and
the checks that it fits a target."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from .config import from_config_file


def reference_layer_ids(target_layers: int, draft_layers: int) -> list[int]:
    """DFlash's reference choice of target layers when a drafter's config names none (its
    build_target_layer_ids): one per draft layer, evenly from layer 1 to layer target_layers - 3
    (Kimi K2.5 / K2.6, 61 layers, 6 draft layers: [1, 12, 24, 35, 47, 58])."""
    if draft_layers == 1:
        return [target_layers // 2]
    start, end = 1, target_layers - 3
    return [int(round(start + i * (end - start) / (draft_layers - 1))) for i in range(draft_layers)]


@dataclass(frozen=True)
class DrafterConfig:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    vocab_size: int
    attention_bias: bool
    # dflash_config
    target_layer_ids: tuple[int, ...]  # () when config.json leaves them to DFlash's rule (for_target)
    block_size: int
    mask_token_id: int

    def for_target(self, target_cfg) -> "DrafterConfig":
        """This config with its target layers settled for `target_cfg`: as given, or by DFlash's
        reference rule when config.json gives none (reference_layer_ids)."""
        if self.target_layer_ids:
            return self
        ids = reference_layer_ids(target_cfg.num_hidden_layers, self.num_hidden_layers)
        return dataclasses.replace(self, target_layer_ids=tuple(ids))

    @classmethod
    def from_dict(cls, raw: dict) -> "DrafterConfig":
        dflash = raw.get("dflash_config") or {}
        layer_ids = dflash.get("target_layer_ids", raw.get("target_layer_ids")) or ()
        mask = dflash.get("mask_token_id", raw.get("mask_token_id"))
        if mask is None:
            raise ValueError("drafter config.json lacks dflash_config.mask_token_id")
        if (raw.get("rope_scaling") or {}).get("rope_type", "default") not in ("default", None):
            raise NotImplementedError(f"drafter rope_scaling {raw['rope_scaling']} is not supported yet")
        unsupported = {k: raw.get(k, dflash.get(k)) for k in ("output_multiplier", "final_logit_softcapping", "input_embedding_scale")}
        unsupported = {k: v for k, v in unsupported.items() if v not in (None, 1, 1.0, 0, 0.0)}
        causal = raw.get("is_causal") or any(t != "full_attention" for t in raw.get("layer_types") or [])
        if unsupported or causal:
            raise NotImplementedError(
                f"drafter variant not supported yet: {unsupported or 'causal / sliding-window layers'}"
            )
        heads = raw["num_attention_heads"]
        return cls(
            hidden_size=raw["hidden_size"], intermediate_size=raw["intermediate_size"],
            num_hidden_layers=raw["num_hidden_layers"], num_attention_heads=heads,
            num_key_value_heads=raw.get("num_key_value_heads", heads),
            head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6), rope_theta=raw.get("rope_theta", 1e6),
            vocab_size=raw["vocab_size"], attention_bias=raw.get("attention_bias", False),
            target_layer_ids=tuple(layer_ids), block_size=int(dflash.get("block_size", raw.get("block_size", 16))),
            mask_token_id=int(mask),
        )

    @classmethod
    def from_pretrained(cls, path: str | Path) -> "DrafterConfig":
        return from_config_file(path, cls.from_dict, "a DFlash drafter's config")


def check_pair(target_cfg, drafter_cfg: DrafterConfig) -> None:
    """A drafter shares the target's embedding and lm_head and reads its layers' outputs: refuse a
    mismatched pair before any compute."""
    if drafter_cfg.hidden_size != target_cfg.hidden_size:
        raise ValueError(f"drafter hidden_size {drafter_cfg.hidden_size} != target hidden_size {target_cfg.hidden_size}")
    if drafter_cfg.vocab_size != target_cfg.vocab_size:
        raise ValueError(f"drafter vocab_size {drafter_cfg.vocab_size} != target vocab_size {target_cfg.vocab_size}")
    ids = list(drafter_cfg.target_layer_ids)
    if not ids:
        raise ValueError("drafter target_layer_ids is empty")
    if ids != sorted(set(ids)):
        # Features are concatenated in this order and fc was trained on it: a repeat or a swap
        # would feed the drafter the wrong layers without any shape error.
        raise ValueError(f"drafter target_layer_ids {ids} must be strictly increasing (no repeats)")
    bad = [i for i in ids if not 0 <= i < target_cfg.num_hidden_layers]
    if bad:
        raise ValueError(f"drafter target_layer_ids {bad} out of range for a {target_cfg.num_hidden_layers}-layer target")
    if not 0 <= drafter_cfg.mask_token_id < target_cfg.vocab_size:
        raise ValueError(f"drafter mask_token_id {drafter_cfg.mask_token_id} is not in the vocabulary")
