"""Target model configuration, read straight from a Hugging Face config.json.

Covers DeepseekV3ForCausalLM and its relatives (Kimi K2, Moonlight, DeepSeek-V2-Lite style MoE):
MLA attention with optional q LoRA, YaRN rope, and a routed + shared expert MoE; and the text model
inside a multimodal wrapper (Kimi K2.5 / K2.6: `KimiK25ForConditionalGeneration`, whose
config.json nests the text model's under `text_config` and whose text weights carry the prefix
TEXT_PREFIX). Routed experts may be packed INT4 (models/quant.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from .quant import Int4Experts, expert_quantization

SUPPORTED_ARCHITECTURES = ("DeepseekV3ForCausalLM", "DeepseekV2ForCausalLM", "KimiK2ForCausalLM")
WRAPPERS = ("KimiK25ForConditionalGeneration",)  # a text model nested in a multimodal one
TEXT_PREFIX = "language_model."  # the wrapped text model's weight names start with it


def text_config(raw: dict) -> tuple[dict, str]:
    """(the text model's config dict, the prefix of its weight names) from a config.json dict: the
    dict itself and "", or for a multimodal wrapper its `text_config` (with the wrapper's
    quantization_config when the text part has none) and TEXT_PREFIX."""
    archs = raw.get("architectures") or []
    if not set(archs) & set(WRAPPERS) and "text_config" not in raw:
        return raw, ""
    text = raw.get("text_config")
    if not isinstance(text, dict):
        raise ValueError(f"config.json of {archs} has no text_config to read the language model from")
    text = dict(text)
    if "quantization_config" not in text and raw.get("quantization_config"):
        text["quantization_config"] = raw["quantization_config"]
    text.setdefault("architectures", ["DeepseekV3ForCausalLM"])
    return text, TEXT_PREFIX


@dataclass(frozen=True)
class TargetConfig:
    # dims
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    # mla
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    # moe
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    first_k_dense_replace: int
    moe_layer_freq: int
    scoring_func: str  # "sigmoid" (noaux_tc, V3 / K2) or "softmax" (V2)
    topk_method: str  # "noaux_tc", "greedy" or "group_limited_greedy"
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    routed_scaling_factor: float
    # rope / yarn
    rope_theta: float
    rope_interleave: bool
    rope_scaling: dict | None  # {"type": "yarn", "factor", "original_max_position_embeddings", ...}
    max_position_embeddings: int
    # storage
    int4_experts: Int4Experts | None = None  # the routed experts packed INT4 (None: 16-bit)

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def is_moe_layer(self, layer: int) -> bool:
        return self.n_routed_experts > 0 and layer >= self.first_k_dense_replace and layer % self.moe_layer_freq == 0

    @classmethod
    def from_dict(cls, raw: dict) -> "TargetConfig":
        """Build from a config.json dict (a multimodal wrapper's: its text part); refuses unknown
        architectures and quantization other than INT4 routed experts (models/quant.py)."""
        raw, _ = text_config(raw)
        int4 = expert_quantization(raw)
        archs = raw.get("architectures") or []
        if archs and not set(archs) & set(SUPPORTED_ARCHITECTURES):
            raise ValueError(f"unsupported architecture {archs}; supported: {SUPPORTED_ARCHITECTURES}")
        # transformers >= 5 writes rope_parameters; original checkpoints write rope_theta + rope_scaling.
        rope = dict(raw.get("rope_parameters") or {})
        scaling = raw.get("rope_scaling") or (rope if rope.get("rope_type", rope.get("type")) not in (None, "default") else None)
        if scaling is not None:
            scaling = dict(scaling)
            scaling.setdefault("type", scaling.get("rope_type"))
        n_routed = raw.get("n_routed_experts") or 0
        if int4 is not None:
            widths = {"hidden_size": raw["hidden_size"], "moe_intermediate_size": raw.get("moe_intermediate_size") or 0}
            bad = {k: v for k, v in widths.items() if v % int4.group_size}
            if bad or not n_routed:
                raise ValueError(f"INT4 routed experts in groups of {int4.group_size} need experts whose widths it "
                                 f"divides; got {bad or 'no routed experts'}")
        return cls(
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_hidden_layers=raw["num_hidden_layers"],
            num_attention_heads=raw["num_attention_heads"],
            rms_norm_eps=raw.get("rms_norm_eps") or 1e-6,
            tie_word_embeddings=raw.get("tie_word_embeddings", False),
            q_lora_rank=raw.get("q_lora_rank"),
            kv_lora_rank=raw["kv_lora_rank"],
            qk_nope_head_dim=raw["qk_nope_head_dim"],
            qk_rope_head_dim=raw["qk_rope_head_dim"],
            v_head_dim=raw["v_head_dim"],
            n_routed_experts=n_routed,
            n_shared_experts=raw.get("n_shared_experts") or 0,
            num_experts_per_tok=raw.get("num_experts_per_tok") or 0,
            moe_intermediate_size=raw.get("moe_intermediate_size") or 0,
            first_k_dense_replace=raw.get("first_k_dense_replace") or 0,
            moe_layer_freq=raw.get("moe_layer_freq") or 1,
            scoring_func=raw.get("scoring_func") or ("sigmoid" if raw.get("topk_method", "noaux_tc") == "noaux_tc" else "softmax"),
            topk_method=raw.get("topk_method") or "noaux_tc",
            n_group=raw.get("n_group") or 1,
            topk_group=raw.get("topk_group") or 1,
            norm_topk_prob=raw.get("norm_topk_prob", True),
            routed_scaling_factor=raw.get("routed_scaling_factor") or 1.0,
            rope_theta=raw.get("rope_theta", rope.get("rope_theta", 10000.0)),
            rope_interleave=raw.get("rope_interleave", True),
            rope_scaling=scaling,
            max_position_embeddings=raw.get("max_position_embeddings", 4096),
            int4_experts=int4,
        )

    @classmethod
    def from_pretrained(cls, path: str | Path) -> "TargetConfig":
        if not (Path(path) / "config.json").is_file():
            raise FileNotFoundError(f"no config.json in {path}")
        return from_config_file(path, cls.from_dict, "a DeepSeek-V3 / Kimi K2 config")


def from_config_file(path: str | Path, build, holder: str):
    """build(the dict in path/config.json), with a file that is not JSON or lacks a field `build`
    reads refused as one ValueError naming the file (holder: what such a config is, for the message)."""
    file = Path(path) / "config.json"
    try:
        return build(json.loads(file.read_text()))
    except json.JSONDecodeError as err:
        raise ValueError(f"{file} is not valid JSON ({err})") from None
    except KeyError as err:
        raise ValueError(f"{file} lacks {err.args[0]!r}, which {holder} holds") from None
