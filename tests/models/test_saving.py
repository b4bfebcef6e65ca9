"""save_target / save_drafter write directories that load_target, load_drafter and transformers'
own DeepseekV3 read back to the same model (sharded, tied and untied embeddings)."""

import json

import pytest
import torch

pytest.importorskip("transformers")
import transformers  # noqa: E402

from ddtree.models import (Drafter, DrafterConfig, TargetConfig, load_drafter, load_target, random_target,  # noqa: E402
                           save_drafter, save_target)

from ..engine.pairs import drafter_config  # noqa: E402
from .checkpoints import tiny_config  # noqa: E402


@pytest.mark.parametrize("tied", [False, True])
def test_target_round_trip_and_transformers_reads_it(tmp_path, tied):
    raw = tiny_config(tie_word_embeddings=tied).to_dict()
    raw["architectures"] = ["DeepseekV3ForCausalLM"]
    model = random_target(TargetConfig.from_dict(raw), dtype=torch.float32, seed=1, std=0.2)
    with torch.no_grad():  # a non-zero router bias, so its name and place are checked too
        for layer in model.layers[1:]:
            layer.mlp.gate.e_score_correction_bias.normal_(0, 0.1)
    if tied:
        model.lm_head.weight = model.embed_tokens.weight
    save_target(model, raw, tmp_path, dtype=torch.float32, max_shard_bytes=40_000)
    files = sorted(p.name for p in tmp_path.glob("*.safetensors"))
    assert len(files) > 1 and (tmp_path / "model.safetensors.index.json").is_file()
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]
    assert ("lm_head.weight" in index) != tied
    loaded = load_target(tmp_path, dtype=torch.float32)
    for (name, a), (_, b) in zip(model.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(a, b), name
    ids = torch.randint(0, raw["vocab_size"], (2, 9), generator=torch.Generator().manual_seed(0))
    hf = transformers.DeepseekV3ForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits.float(), model.logits(ids), rtol=1e-4, atol=1e-4)


def test_drafter_round_trip(tmp_path):
    raw = tiny_config().to_dict()
    target = random_target(TargetConfig.from_dict(raw), dtype=torch.float32)
    draw = drafter_config(96, 4)
    torch.manual_seed(0)
    drafter = Drafter(DrafterConfig.from_dict(draw))
    with torch.no_grad():
        for p in drafter.parameters():
            p.normal_()
    save_drafter(drafter, draw, tmp_path, dtype=torch.float32)
    loaded = load_drafter(tmp_path, target)
    for (name, a), (_, b) in zip(drafter.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(a, b), name


def test_a_tensor_larger_than_a_shard_is_refused(tmp_path):
    model = random_target(TargetConfig.from_dict(tiny_config().to_dict()), dtype=torch.float32)
    with pytest.raises(ValueError, match="larger than max_shard_bytes"):
        save_target(model, tiny_config().to_dict(), tmp_path, max_shard_bytes=100)


def test_saving_again_replaces_earlier_shards_and_index(tmp_path):
    raw = tiny_config().to_dict()
    first = random_target(TargetConfig.from_dict(raw), dtype=torch.float32, seed=1)
    second = random_target(TargetConfig.from_dict(raw), dtype=torch.float32, seed=2)
    save_target(first, raw, tmp_path, dtype=torch.float32, max_shard_bytes=40_000)  # sharded, with an index
    save_target(second, raw, tmp_path, dtype=torch.float32, max_shard_bytes=1 << 30)  # one file
    assert sorted(p.name for p in tmp_path.glob("model*")) == ["model.safetensors"]
    loaded = load_target(tmp_path, dtype=torch.float32)
    assert torch.equal(loaded.embed_tokens.weight, second.embed_tokens.weight)


def test_a_tied_config_with_a_separate_lm_head_is_refused(tmp_path):
    raw = tiny_config(tie_word_embeddings=True).to_dict()
    model = random_target(TargetConfig.from_dict(raw), dtype=torch.float32)  # lm_head not tied to the embedding
    with pytest.raises(ValueError, match="ties lm_head"):
        save_target(model, raw, tmp_path)
