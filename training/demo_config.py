"""The demo pair's shapes: a small Kimi-K2-architecture target and its DFlash drafter.

Kimi K2's architecture at toy width: MLA with q and kv LoRA (kv_lora_rank 512 and rope dim 64,
the verify kernel's real latent shape), YaRN rope, first layer dense, then MoE layers with the
noaux_tc sigmoid router, one shared expert and routed_scaling_factor as Kimi K2's. Sized so that
target + drafter + tokenizer fit in 32 MiB in bf16 (tied embeddings: the vocabulary is the
largest single cost at this width).
"""

from __future__ import annotations

VOCAB = 4096
EOT, MASK = "<|endoftext|>", "<|mask|>"  # the tokenizer's first two ids: 0 and 1
EOT_ID, MASK_ID = 0, 1
SEQ_LEN = 1024  # training window; YaRN stretches the rope 4x beyond it


def target_config(vocab_size: int = VOCAB) -> dict:
    return {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "vocab_size": vocab_size,
        "hidden_size": 384,
        "intermediate_size": 1024,
        "moe_intermediate_size": 64,
        "num_hidden_layers": 6,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "q_lora_rank": 192,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 64,
        "qk_rope_head_dim": 64,
        "v_head_dim": 64,
        "n_routed_experts": 8,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "first_k_dense_replace": 1,
        "moe_layer_freq": 1,
        "n_group": 1,
        "topk_group": 1,
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "norm_topk_prob": True,
        "routed_scaling_factor": 2.827,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "rope_theta": 50000.0,
        "rope_interleave": True,
        "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": SEQ_LEN,
                         "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0},
        "max_position_embeddings": 4 * SEQ_LEN,
        "tie_word_embeddings": True,
        "attention_bias": False,
        "initializer_range": 0.02,
        "bos_token_id": EOT_ID,
        "eos_token_id": EOT_ID,
        "torch_dtype": "bfloat16",
    }


def drafter_config(vocab_size: int = VOCAB) -> dict:
    return {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": 384,
        "intermediate_size": 768,
        "num_hidden_layers": 3,
        "num_attention_heads": 6,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "rms_norm_eps": 1e-6,
        "rope_theta": 50000.0,
        "vocab_size": vocab_size,
        "attention_bias": False,
        "torch_dtype": "bfloat16",
        # target layers 1, 3, 5 of 0..5: spread over the stack, the last one included
        "dflash_config": {"target_layer_ids": [1, 3, 5], "block_size": 16, "mask_token_id": MASK_ID},
    }
