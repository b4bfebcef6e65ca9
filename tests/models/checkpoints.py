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
