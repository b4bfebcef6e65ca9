"""Small random DeepseekV3 checkpoints written by transformers' own implementation."""

import torch
import transformers


def tiny_config(**overrides):
    base = dict(
        vocab_size=96, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8,
        routed_scaling_factor=2.5, kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=16, v_head_dim=24,
        qk_nope_head_dim=24, n_group=4, topk_group=2, num_experts_per_tok=3, first_k_dense_replace=1,
        norm_topk_prob=True, max_position_embeddings=512, tie_word_embeddings=False,
        rope_scaling={"type": "yarn", "factor": 8.0, "original_max_position_embeddings": 64,
                      "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
    )
    base.update(overrides)
    return transformers.DeepseekV3Config(**base)


def save_tiny(tmp_path, config, seed=0):
    torch.manual_seed(seed)
    model = transformers.DeepseekV3ForCausalLM(config).float().eval()
    with torch.no_grad():  # random router bias and norms, so routing and scales are exercised
        for name, p in model.named_parameters():
            if "e_score_correction_bias" in name or "layernorm" in name or name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn_like(p))
    for layer in model.model.layers:  # the bias is a buffer in transformers
        gate = getattr(layer.mlp, "gate", None)
        if gate is not None:
            gate.e_score_correction_bias.copy_(0.1 * torch.randn_like(gate.e_score_correction_bias))
    model.save_pretrained(tmp_path)
    return model


def save_tiny_v2(tmp_path, seed=0):
    """A DeepSeek-V2-Lite style checkpoint: no q LoRA, softmax greedy router, YaRN mscale 0.707."""
    config = transformers.DeepseekV2Config(
        vocab_size=96, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=4, n_shared_experts=2, n_routed_experts=8,
        routed_scaling_factor=1.0, kv_lora_rank=32, q_lora_rank=None, qk_rope_head_dim=16, v_head_dim=24,
        qk_nope_head_dim=24, topk_method="greedy", num_experts_per_tok=3, first_k_dense_replace=1,
        norm_topk_prob=False, max_position_embeddings=512,
        rope_scaling={"type": "yarn", "factor": 8.0, "original_max_position_embeddings": 64,
                      "beta_fast": 32, "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707},
    )
    torch.manual_seed(seed)
    model = transformers.DeepseekV2ForCausalLM(config).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("gate.weight"):
                p.normal_(0, 0.5)  # transformers starts the router at zero: make routing matter
    model.save_pretrained(tmp_path)
    return model


def tiny_float32_target(tmp_path_factory):
    """The tiny checkpoint (tiny_config) saved, then loaded as a float32 ddtree Target."""
    from ddtree.models import load_target

    path = tmp_path_factory.mktemp("tiny")
    save_tiny(path, tiny_config())
    return load_target(path, dtype=torch.float32)


def shuffled_block_table(batch: int, pages_each: int, seed: int) -> torch.Tensor:
    """int32 [batch, pages_each]: distinct pages in shuffled order, 3 pages of the pool unused."""
    order = torch.randperm(batch * pages_each + 3, generator=torch.Generator().manual_seed(seed))
    return order[: batch * pages_each].view(batch, pages_each).int()


def int4_quantization_config(group_size: int = 8, **weights) -> dict:
    """compressed-tensors' quantization_config for INT4 routed experts, as Kimi K2.6 publishes it
    (the other Linears ignored); `weights` overrides fields of the scheme's weights."""
    return {
        "quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": None, "output_activations": None,
                                      "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                                                  "group_size": group_size, "dynamic": False, **weights}}},
        "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|down)_proj.*"],
    }


def save_tiny_int4(tmp_path, config, *, group_size: int = 8, wrapped: bool = False, seed: int = 0):
    """A tiny DeepseekV3 checkpoint (save_tiny) whose routed experts are rewritten as INT4 by
    compressed-tensors' own compressor (weight_packed, weight_scale, weight_shape per expert Linear),
    with the quantization_config. wrapped: laid out as Kimi K2.5 / K2.6 (KimiK25ForConditionalGeneration,
    the text config under text_config, the text weights under language_model., and a vision tower
    stored as int8, which a loader must never read). Returns {expert tensor name: the weight
    compressed-tensors decompresses, bf16}."""
    import json
    from pathlib import Path

    from compressed_tensors.compressors.pack_quantized import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from compressed_tensors.quantization.utils import calculate_qparams
    from safetensors.torch import load_file, save_file

    tmp_path = Path(tmp_path)
    save_tiny(tmp_path, config, seed)
    files = sorted(tmp_path.glob("*.safetensors"))
    tensors = {k: v for f in files for k, v in load_file(f).items()}
    for f in files:
        f.unlink()
    (tmp_path / "model.safetensors.index.json").unlink(missing_ok=True)
    args = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=group_size)
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    out, decompressed = {}, {}
    for name, t in tensors.items():
        if ".mlp.experts." not in name:
            out[name] = t.to(torch.bfloat16)
            continue
        w = t.to(torch.bfloat16)
        groups = w.float().view(w.shape[0], -1, group_size)
        scale, zero = calculate_qparams(groups.amin(-1), groups.amax(-1), args)
        packed = PackedQuantizationCompressor.compress({"weight": w, "weight_scale": scale.to(torch.bfloat16),
                                                        "weight_zero_point": zero}, scheme)
        base = name.removesuffix(".weight")
        for key, value in packed.items():
            out[f"{base}.{key}"] = value
        decompressed[name] = PackedQuantizationCompressor.decompress(packed, scheme)["weight"]
    raw = json.loads((tmp_path / "config.json").read_text())
    raw["quantization_config"] = int4_quantization_config(group_size)
    if wrapped:
        out = {f"language_model.{k}": v for k, v in out.items()}
        out["vision_tower.patch_embed.weight"] = torch.zeros(4, 4, dtype=torch.int8)
        quant = raw.pop("quantization_config")
        raw = {"architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25", "text_config": raw,
               "vision_config": {"hidden_size": 4}, "quantization_config": quant}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    save_file(out, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    return decompressed
