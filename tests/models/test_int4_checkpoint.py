"""Kimi K2.6's checkpoint layout: INT4 routed experts written by compressed-tensors' own compressor,
bare or inside the multimodal wrapper (text_config, language_model. prefix, a vision tower never
read). The loaded experts, dequantized, are what compressed-tensors decompresses; the INT4 target
computes what its dequantized twin computes; bad layouts get one clear error each."""

import dataclasses
import json

import pytest
import torch

pytest.importorskip("compressed_tensors")
pytest.importorskip("transformers")

from ddtree.models import load_target, random_target  # noqa: E402
from ddtree.models.layers import MoE  # noqa: E402
from ddtree.ops import KERNELS, apply_policy  # noqa: E402
from ddtree.ops.int4 import dequantize_int4  # noqa: E402

from .checkpoints import int4_quantization_config, save_tiny_int4, tiny_config  # noqa: E402
from .test_fused_target import PAGE, chain_meta  # noqa: E402


@pytest.fixture(scope="module")
def int4_dirs(tmp_path_factory):
    bare, wrapped = tmp_path_factory.mktemp("int4"), tmp_path_factory.mktemp("k26")
    return (bare, save_tiny_int4(bare, tiny_config())), (wrapped, save_tiny_int4(wrapped, tiny_config(), wrapped=True))


def expert_weight(moe: MoE, e: int, proj: str) -> torch.Tensor:
    """[out, in] of expert e's `proj`, dequantized to bf16 from the MoE's packed storage."""
    gate_up, down = moe.experts()
    inter = moe.inter
    if proj == "down_proj":
        return dequantize_int4(down, torch.bfloat16)[e]
    rows = slice(0, inter) if proj == "gate_proj" else slice(inter, 2 * inter)
    return dequantize_int4(gate_up, torch.bfloat16)[e, rows]


@pytest.mark.parametrize("which", [0, 1], ids=["bare", "kimi-k2.6-wrapper"])
def test_the_loaded_experts_are_what_compressed_tensors_decompresses(int4_dirs, which):
    path, decompressed = int4_dirs[which]
    model = load_target(path, dtype=torch.float32)
    assert model.cfg.int4_experts.group_size == 8
    moes = [(i, layer.mlp) for i, layer in enumerate(model.layers) if isinstance(layer.mlp, MoE)]
    assert len(moes) == 2 and all(m.w_gate_up_packed.dtype == torch.int32 for _, m in moes)
    for i, moe in moes:
        for e in range(model.cfg.n_routed_experts):
            for proj in ("gate_proj", "up_proj", "down_proj"):
                want = decompressed[f"model.layers.{i}.mlp.experts.{e}.{proj}.weight"]
                assert torch.equal(expert_weight(moe, e, proj), want), (i, e, proj)


def twin_of(model):
    """The same target with 16-bit experts: the INT4 ones dequantized (float32)."""
    twin = random_target(dataclasses.replace(model.cfg, int4_experts=None), dtype=torch.float32)
    state = {k: v for k, v in model.state_dict().items() if ".mlp.w_" not in k}
    twin.load_state_dict(state, strict=False)
    for layer, twin_layer in zip(model.layers, twin.layers):
        if isinstance(layer.mlp, MoE):
            gate_up, down = layer.mlp.experts()
            twin_layer.mlp.w_gate_up.data.copy_(dequantize_int4(gate_up, torch.float32).transpose(1, 2))
            twin_layer.mlp.w_down.data.copy_(dequantize_int4(down, torch.float32).transpose(1, 2))
    return twin.eval()


@pytest.mark.parametrize("kernels", [False, True], ids=["reference", "kernels"])
def test_the_int4_target_computes_what_its_dequantized_twin_computes(int4_dirs, kernels):
    model = load_target(int4_dirs[1][0], dtype=torch.float32)
    twin = twin_of(model)
    if kernels:  # the fused INT4 MoE (the interpreter on the CPU) against the fused 16-bit one
        apply_policy(model, KERNELS)
        apply_policy(twin, KERNELS)
    ids = torch.randint(0, 96, (2, 5), generator=torch.Generator().manual_seed(0))
    meta = chain_meta([0, 0], 5, [5, 4])
    outs = []
    for m in (model, twin):
        caches = m.new_cache(6, PAGE)
        with torch.no_grad():
            outs.append(m.forward_paged(ids, meta, caches, hidden_layers=(1,)))
    (logits, hidden), (want, want_hidden) = outs
    if not kernels:
        assert torch.equal(logits, want) and torch.equal(hidden[0], want_hidden[0])
        return
    # the fused 16-bit twin sums in its own tiles (another order than INT4_TILES): equal within
    # float32's rounding here; bit for bit in the same tiles is tests/ops/test_int4.py's
    torch.testing.assert_close(logits, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(hidden[0], want_hidden[0], rtol=1e-5, atol=1e-5)


def write(path, raw):
    (path / "config.json").write_text(json.dumps(raw))


def test_unsupported_and_broken_layouts_are_refused(int4_dirs, tmp_path):
    import shutil

    src = int4_dirs[0][0]
    raw = json.loads((src / "config.json").read_text())
    for i, (quant, error, match) in enumerate([
        (int4_quantization_config(8, symmetric=False), NotImplementedError, r"weights.symmetric=False is not supported"),
        (int4_quantization_config(8, num_bits=8), NotImplementedError, r"weights.num_bits=8 is not supported"),
        (int4_quantization_config(12), ValueError, r"group_size=12: need a positive multiple of 8"),
        (dict(int4_quantization_config(8), format="int-quantized"), NotImplementedError, "format='int-quantized'"),
    ]):
        bad = tmp_path / f"bad{i}"
        shutil.copytree(src, bad)
        write(bad, dict(raw, quantization_config=quant))
        with pytest.raises(error, match=match):
            load_target(bad, dtype=torch.float32)
    wrong_group = tmp_path / "group16"
    shutil.copytree(src, wrong_group)
    write(wrong_group, dict(raw, quantization_config=int4_quantization_config(16)))
    with pytest.raises(ValueError, match=r"experts.0.down_proj.weight_scale has shape \(64, 4\), expected \(64, 2\)"):
        load_target(wrong_group, dtype=torch.float32)


def test_a_missing_scale_and_16_bit_experts_under_an_int4_config(int4_dirs, tmp_path):
    from safetensors.torch import load_file, save_file

    src = int4_dirs[0][0]
    raw = json.loads((src / "config.json").read_text())
    tensors = load_file(src / "model.safetensors")
    missing = tmp_path / "missing"
    missing.mkdir()
    write(missing, raw)
    save_file({k: v for k, v in tensors.items() if k != "model.layers.2.mlp.experts.5.up_proj.weight_scale"},
              str(missing / "model.safetensors"))
    with pytest.raises(ValueError, match=r"lacks 1 tensor\(s\), first: \['model.layers.2.mlp.experts.5.up_proj.weight_scale'\]"):
        load_target(missing, dtype=torch.float32)
    sixteen = tmp_path / "sixteen"
    sixteen.mkdir()
    write(sixteen, raw)
    tensors = dict(tensors)
    tensors["model.layers.1.mlp.experts.0.gate_proj.weight"] = torch.zeros(32, 64, dtype=torch.bfloat16)
    save_file(tensors, str(sixteen / "model.safetensors"))
    with pytest.raises(ValueError, match="quantization_config says the routed experts are INT4 .group 8., which stores no weight"):
        load_target(sixteen, dtype=torch.float32)


def test_generate_with_the_int4_target_equals_its_twin(int4_dirs, tmp_path):
    """The engine end to end (prefill, rounds, auto and fixed budgets, plain steps) on the INT4
    Kimi K2.6-layout target: greedy tokens equal its dequantized twin's, and ar's."""
    from ddtree import Engine
    from ddtree.models import load_drafter

    from ..engine.pairs import drafter_config, prompts, save_drafter

    save_drafter(tmp_path / "drafter", drafter_config(96, 4))
    model = load_target(int4_dirs[1][0], dtype=torch.float32)
    twin = twin_of(model)
    batch = prompts(3, 96, seed=4)
    outs = {}
    for name, target in (("int4", model), ("twin", twin)):
        engine = Engine(target, load_drafter(tmp_path / "drafter", target), page_size=8, max_batch=4)
        outs[name] = [[o.token_ids for o in engine.generate(batch, max_new_tokens=12, mode=mode, budget=budget)]
                      for mode, budget in (("ar", 1), ("ddtree", 6), ("ddtree", "auto"))]
    assert outs["int4"] == outs["twin"]
    assert outs["int4"][1] == outs["int4"][0] == outs["int4"][2]  # lossless: ddtree and auto commit ar's tokens


def test_random_int4_weights_for_benchmarks():
    """random_target builds INT4 experts packed as a checkpoint stores them, with the other weights'
    spread: every 4-bit value about equally often, dequantized std near the requested 0.02."""
    from ddtree.models import TargetConfig

    raw = dict(tiny_config().to_dict(), quantization_config=int4_quantization_config(8))
    model = random_target(TargetConfig.from_dict(raw), dtype=torch.float32, std=0.02)
    moe = model.layers[1].mlp
    gate_up, down = moe.experts()
    values = torch.bincount((torch.cat([(gate_up.packed[..., None] >> s) & 0xF for s in range(0, 32, 4)]).flatten()),
                            minlength=16)
    assert values.min() > 0.8 * values.float().mean()
    std = float(dequantize_int4(down, torch.float32).std())
    assert 0.012 < std < 0.03
    with torch.no_grad():
        logits, _ = model(torch.tensor([[1, 2, 3]]))
    assert torch.isfinite(logits).all()


def test_the_kimi_k26_benchmark_config():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from round_setup import drafter_config, target_config

    cfg, full, shape = target_config("kimi-k2.6", 4)
    assert full == 61 and cfg.num_hidden_layers == 4 and cfg.int4_experts.group_size == 32
    assert (cfg.hidden_size, cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (7168, 384, 8, 2048)
    drafter = drafter_config(cfg, **shape)
    assert (drafter.num_hidden_layers, drafter.num_attention_heads, drafter.num_key_value_heads, drafter.block_size) == (6, 64, 8, 8)
    full_cfg, _, _ = target_config("kimi-k2.6", None)
    assert drafter_config(full_cfg, **shape).target_layer_ids == (1, 12, 24, 35, 47, 58)  # the published K2.5 drafter's


def test_the_round_floor_counts_int4_experts_by_their_bytes():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from round_floors import ModelCounts
    from round_setup import drafter_config

    from ddtree.models import Drafter, TargetConfig

    raw = dict(tiny_config().to_dict(), quantization_config=int4_quantization_config(8))
    cfg = TargetConfig.from_dict(raw)
    target = random_target(cfg, dtype=torch.bfloat16)
    counts = ModelCounts.of(target, Drafter(drafter_config(cfg)))
    h, i = cfg.hidden_size, cfg.moe_intermediate_size
    assert counts.expert_bytes == 3 * h * i / 2 + 3 * h * i / 8 * 2  # 4-bit words, one bf16 scale per 8
    sixteen = ModelCounts.of(random_target(dataclasses.replace(cfg, int4_experts=None)), Drafter(drafter_config(cfg)))
    assert sixteen.expert_bytes == 3 * h * i * 2 and sixteen.dense == counts.dense


def test_the_wrapper_names_its_stop_tokens_in_its_text_config(int4_dirs, tmp_path):
    from ddtree.engine.loading import stop_token_ids

    import shutil

    bare, wrapped = int4_dirs[0][0], tmp_path / "wrapped"
    shutil.copytree(int4_dirs[1][0], wrapped)
    (wrapped / "generation_config.json").unlink(missing_ok=True)  # config.json alone names them
    text = json.loads((wrapped / "config.json").read_text())["text_config"]
    assert "eos_token_id" not in json.loads((wrapped / "config.json").read_text())
    assert stop_token_ids(wrapped) == stop_token_ids(bare) == (int(text["eos_token_id"]),)
