"""The target against transformers' own DeepseekV3 on small random checkpoints (float32)."""

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from ddtree.models import TargetConfig, load_target  # noqa: E402

from .checkpoints import save_tiny, save_tiny_v2, tiny_config  # noqa: E402


@pytest.mark.parametrize(
    "overrides",
    [{}, {"q_lora_rank": None}, {"rope_scaling": None, "rope_interleave": False}, {"n_group": 1, "topk_group": 1}],
    ids=["v3", "no-q-lora", "plain-rope", "moonlight-groups"],
)
def test_prefill_logits_and_hidden_states_match(tmp_path, overrides):
    ref = save_tiny(tmp_path, tiny_config(**overrides))
    ours = load_target(tmp_path, dtype=torch.float32)
    ids = torch.randint(0, 96, (2, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = ref(ids, output_hidden_states=True)
        logits, hidden = ours(ids, hidden_layers=(0, 2))
    torch.testing.assert_close(logits, want.logits.float(), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(hidden[0], want.hidden_states[1], rtol=1e-4, atol=1e-4)
    assert torch.equal(ours.logits(ids), logits)


def test_deepseek_v2_lite_style_matches(tmp_path):
    ref = save_tiny_v2(tmp_path)
    ours = load_target(tmp_path, dtype=torch.float32)
    assert ours.cfg.scoring_func == "softmax" and ours.cfg.topk_method == "greedy"
    ids = torch.randint(0, 96, (2, 11), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(ours.logits(ids), ref(ids).logits.float(), rtol=1e-4, atol=1e-4)


def test_config_reads_both_rope_formats():
    raw = json.loads(tiny_config().to_json_string())
    cfg = TargetConfig.from_dict(raw)
    assert cfg.rope_scaling["type"] == "yarn" and cfg.rope_scaling["factor"] == 8.0
    old = dict(raw, rope_scaling={"type": "yarn", "factor": 8.0, "original_max_position_embeddings": 64}, rope_theta=5e4)
    old.pop("rope_parameters", None)
    cfg_old = TargetConfig.from_dict(old)
    assert cfg_old.rope_theta == 5e4 and cfg_old.rope_scaling["factor"] == 8.0


def test_bad_checkpoints(tmp_path):
    save_tiny(tmp_path, tiny_config())
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


def test_random_target_from_config_alone():
    from ddtree.models import random_target

    cfg = TargetConfig.from_dict(json.loads(tiny_config().to_json_string()))
    a = random_target(cfg, dtype=torch.float32, seed=5)
    b = random_target(cfg, dtype=torch.float32, seed=5)
    ids = torch.randint(0, 96, (1, 7), generator=torch.Generator().manual_seed(0))
    logits = a.logits(ids)
    assert torch.isfinite(logits).all() and logits.std() > 0
    assert torch.equal(logits, b.logits(ids))  # same seed, same weights
    assert a.layers[1].mlp.w_gate_up.std().item() == pytest.approx(0.02, rel=0.1)


def test_sharded_checkpoint_streams_and_missing_shard_is_named(tmp_path):
    ref = save_tiny(tmp_path / "full", tiny_config())
    ref.save_pretrained(tmp_path / "sharded", max_shard_size="40KB")
    shards = sorted((tmp_path / "sharded").glob("model-*.safetensors"))
    assert len(shards) > 2 and (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    ids = torch.randint(0, 96, (1, 5), generator=torch.Generator().manual_seed(0))
    a = load_target(tmp_path / "full", dtype=torch.float32).logits(ids)
    b = load_target(tmp_path / "sharded", dtype=torch.float32).logits(ids)
    assert torch.equal(a, b)
    shards[1].unlink()
    with pytest.raises(FileNotFoundError, match=shards[1].name):
        load_target(tmp_path / "sharded")


def test_unexpected_expert_tensor_is_named(tmp_path):
    from safetensors.torch import load_file, save_file

    save_tiny(tmp_path, tiny_config())
    tensors = load_file(tmp_path / "model.safetensors")
    tensors["model.layers.0.mlp.experts.0.up_proj.weight"] = torch.zeros(32, 64)  # layer 0 is dense
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="layers.0.mlp.experts.0.up_proj.weight"):
        load_target(tmp_path, dtype=torch.float32)
