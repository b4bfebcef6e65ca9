"""The memory plan (parallel/memory_plan.py, `ddtree plan`): each rank's weights as the models split
them, counted from config.json alone; Kimi K2.6's against a count by hand; a small pair's against
the loaded models; what does not fit or divide is one line."""

from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from ddtree.cli import main  # noqa: E402
from ddtree.models import load_drafter, load_target  # noqa: E402
from ddtree.models.config import TargetConfig  # noqa: E402
from ddtree.models.drafter_config import DrafterConfig  # noqa: E402
from ddtree.parallel.memory_plan import CONTEXT_BYTES, GIB, parameter_bytes, plan_memory  # noqa: E402

from ..engine.pairs import make_pair  # noqa: E402

KIMI_K26 = Path(__file__).resolve().parents[2] / "benchmarks/configs/kimi-k2.6.json"


@pytest.fixture(scope="module")
def kimi_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("kimi-k2.6")
    (path / "config.json").write_text(KIMI_K26.read_text())
    return path


def test_kimi_k26_on_8_gpus_by_hand(kimi_dir):
    cfg = TargetConfig.from_pretrained(kimi_dir)
    plan = plan_memory(cfg, None, 8, 140 * GIB)
    hidden, inter, layers, experts = 7168, 2048, 61, 384
    moe_layers = layers - 1  # the first layer is dense
    per_expert = 3 * inter * hidden // 2 + 3 * inter * hidden // 32 * 2  # INT4 packed, a bf16 scale per 32 inputs
    assert plan.target["routed experts"] == moe_layers * experts // 8 * per_expert
    assert plan.target["embedding and lm_head"] == 2 * 163840 // 8 * hidden * 2
    # the latent cache whole on every rank; pages: what 32 requests of 8192 tokens (and a tree) use
    assert plan.page_bytes == layers * 64 * (512 + 64) * 2
    assert plan.pages == 32 * -(-(8192 + 256 + 1) // 64) and plan.tokens == plan.pages * 64
    room = 0.85 * (140 * GIB - CONTEXT_BYTES - plan.weights)
    assert plan.pages * plan.page_bytes <= room
    assert 70 * GIB < plan.weights < 72 * GIB
    text = "\n".join(plan.lines())
    assert "each of 8 ranks" in text and "routed experts 66.45" in text


def test_kimi_k26_that_does_not_fit_or_divide_is_one_line(kimi_dir):
    cfg = TargetConfig.from_pretrained(kimi_dir)
    with pytest.raises(ValueError, match=r"at tensor parallel 4 leave no room for a KV cache on GPUs of 140.0 GiB: "
                                         r"tensor parallel 8 fits"):
        plan_memory(cfg, None, 4, 140 * GIB)
    with pytest.raises(ValueError, match=r"vocab_size \(163840\) does not divide among 3 ranks"):
        plan_memory(cfg, None, 3, 140 * GIB)


def test_a_small_pair_counts_what_loads(tmp_path):
    """The plan's weights are the loaded models' bytes, whole and per rank (routed experts and
    heads halve at 2 ranks; the drafter is whole)."""
    target_dir, drafter_dir, _ = make_pair(tmp_path)
    target = load_target(target_dir, dtype=torch.float32)
    drafter = load_drafter(drafter_dir, target)
    cfg = TargetConfig.from_pretrained(target_dir)
    drafter_cfg = DrafterConfig.from_pretrained(drafter_dir).for_target(cfg)
    plan = plan_memory(cfg, drafter_cfg, 1, 4 * GIB, dtype=torch.float32, max_model_len=256, max_batch=4)
    loaded = sum(p.numel() * p.element_size() for p in target.parameters())
    assert sum(plan.target.values()) == loaded == sum(parameter_bytes(target, torch.float32).values())
    assert plan.drafter == sum(p.numel() * p.element_size() for p in drafter.parameters())
    assert plan.drafter_cache == 2 * 2 * 4 * (256 + 512) * 2 * 16 * 4  # k and v, layers, batch, capacity, heads, dim
    two = plan_memory(cfg, drafter_cfg, 2, 4 * GIB, dtype=torch.float32, max_model_len=256, max_batch=4)
    assert two.target["routed experts"] * 2 == plan.target["routed experts"] > 0
    assert two.drafter == plan.drafter


def test_ddtree_plan_prints_the_plan(kimi_dir, capsys):
    assert main(["plan", "--target", str(kimi_dir), "--tensor-parallel", "8", "--gpu-memory", "140"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("memory plan for each of 8 ranks (140.0 GiB") and "KV cache 4256 pages x 64 slots" in out
    assert main(["plan", "--target", str(kimi_dir), "--tensor-parallel", "4", "--gpu-memory", "140"]) == 1
    assert capsys.readouterr().err.strip().endswith("tensor parallel 8 fits")


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU here gives the memory to plan for")
def test_ddtree_plan_without_a_gpu_needs_its_memory(kimi_dir, capsys):
    assert main(["plan", "--target", str(kimi_dir), "--tensor-parallel", "8"]) == 2
    assert capsys.readouterr().err.strip() == ("ddtree plan: error: no CUDA device here: pass --gpu-memory GIB, "
                                               "the memory of each GPU to plan for")


def test_ddtree_plan_checks_the_pair(kimi_dir, tmp_path, capsys):
    _, drafter_dir, _ = make_pair(tmp_path)  # a drafter for a tiny target, not Kimi K2.6
    capsys.readouterr()
    assert main(["plan", "--target", str(kimi_dir), "--drafter", str(drafter_dir), "--gpu-memory", "140",
                 "--tensor-parallel", "8"]) == 1
    assert capsys.readouterr().err == "ddtree: error: drafter hidden_size 64 != target hidden_size 7168\n"
