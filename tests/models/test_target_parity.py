"""The target against transformers' own DeepseekV3 on small random checkpoints (float32)."""

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from ddtree.models import TargetConfig, load_target  # noqa: E402


def _tiny_config(**overrides):
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


def _save(tmp_path, config, seed=0):
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


@pytest.mark.parametrize("overrides", [{}, {"q_lora_rank": None}, {"rope_scaling": None, "rope_interleave": False}])
def test_prefill_logits_and_hidden_states_match(tmp_path, overrides):
    ref = _save(tmp_path, _tiny_config(**overrides))
    ours = load_target(tmp_path, dtype=torch.float32)
    ids = torch.randint(0, 96, (2, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = ref(ids, output_hidden_states=True)
        logits, hidden = ours(ids, hidden_layers=(0, 2))
    torch.testing.assert_close(logits, want.logits.float(), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(hidden[0], want.hidden_states[1], rtol=1e-4, atol=1e-4)
    assert torch.equal(ours.logits(ids), logits)


def test_config_reads_both_rope_formats():
    raw = json.loads(_tiny_config().to_json_string())
    cfg = TargetConfig.from_dict(raw)
    assert cfg.rope_scaling["type"] == "yarn" and cfg.rope_scaling["factor"] == 8.0
    old = dict(raw, rope_scaling={"type": "yarn", "factor": 8.0, "original_max_position_embeddings": 64}, rope_theta=5e4)
    old.pop("rope_parameters", None)
    cfg_old = TargetConfig.from_dict(old)
    assert cfg_old.rope_theta == 5e4 and cfg_old.rope_scaling["factor"] == 8.0


def test_bad_checkpoints(tmp_path):
    _save(tmp_path, _tiny_config())
    raw = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(dict(raw, quantization_config={"quant_method": "fp8", "fmt": "e4m3"})))
    with pytest.raises(NotImplementedError, match="quant_method='fp8'"):
        load_target(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(dict(raw, hidden_size=80)))
    with pytest.raises(ValueError, match="has shape"):
        load_target(tmp_path, dtype=torch.float32)
    (tmp_path / "config.json").write_text(json.dumps(dict(raw, num_hidden_layers=4)))
    with pytest.raises(ValueError, match="lacks .* tensor"):
        load_target(tmp_path, dtype=torch.float32)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="no model.safetensors"):
        load_target(tmp_path)
