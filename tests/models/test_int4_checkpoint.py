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
    assert torch.equal(logits, want) and torch.equal(hidden[0], want_hidden[0])


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
