"""The engine on a GPU: every stage on its CUDA path (Triton top-k, builder and accept walk; the
tree-verify kernel in bf16 at latent 512), same tokens across modes."""

import json

import pytest
import torch

pytest.importorskip("transformers")

from ddtree import Engine  # noqa: E402
from oracle import OracleDrafter  # noqa: E402 (benchmarks/oracle.py)
from ddtree.models import Drafter, DrafterConfig, TargetConfig, random_target  # noqa: E402

from ..models.checkpoints import tiny_config  # noqa: E402
from .pairs import drafter_config, make_pair, prompts  # noqa: E402

pytestmark = pytest.mark.cuda


def test_float32_on_cuda_equals_the_cpu(tmp_path):
    target_dir, drafter_dir, _ = make_pair(tmp_path)
    batch = prompts(6, 96, seed=8)
    cpu = Engine.from_pretrained(target_dir, drafter_dir, device="cpu", page_size=16, stop_token_ids=())
    want = [o.token_ids for o in cpu.generate(batch, max_new_tokens=24, mode="ar")]
    gpu = Engine.from_pretrained(target_dir, drafter_dir, device="cuda", dtype=torch.float32, page_size=16,
                                 stop_token_ids=())
    for mode, budget in [("ar", 1), ("chain", 1), ("ddtree", 4), ("ddtree", 64), ("ddtree", "auto")]:
        got = gpu.generate(batch, max_new_tokens=24, mode=mode, budget=budget, temperature=0.0)
        assert [o.token_ids for o in got] == want, mode
    sampled = {b: [o.token_ids for o in gpu.generate(batch, max_new_tokens=24, mode="ar" if b == 1 else "ddtree",
                                                      budget=b, temperature=1.0, seed=list(range(6)))]
               for b in (1, 16, "auto")}
    assert sampled[1] == sampled[16] == sampled["auto"]


def _bf16_pair():
    raw = json.loads(tiny_config(kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=64, vocab_size=256).to_json_string())
    target = random_target(TargetConfig.from_dict(raw), dtype=torch.bfloat16, device="cuda", std=0.05)
    with torch.no_grad():
        target.lm_head.weight.mul_(20.0)  # peaked next-token distributions, as a trained model has
    torch.manual_seed(0)
    drafter = Drafter(DrafterConfig.from_dict(drafter_config(vocab=256, block_size=8))).cuda().bfloat16().eval()
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.05 * torch.randn_like(p))
    return target, drafter


def test_bf16_kernel_path_commits_deep_trees():
    target, drafter = _bf16_pair()
    batch = prompts(4, 256, seed=9, lengths=(20, 90))
    ar = Engine(target, drafter, page_size=64, max_batch=4).generate(batch, max_new_tokens=40, mode="ar")
    oracle = OracleDrafter(drafter, max_batch=4, max_len=256)
    for slot, (p, o) in enumerate(zip(batch, ar)):
        oracle.set_sequence(slot, p + o.token_ids)
    outs = Engine(target, oracle, page_size=64, max_batch=4).generate(batch, max_new_tokens=40, mode="ddtree", budget=32)
    lengths = [a for o in outs for a in o.stats.acceptance_lengths]
    same = sum(o.token_ids == a.token_ids for o, a in zip(outs, ar))
    assert same >= 3, f"{same} of 4 requests equal ar in bf16"  # a bf16 near-tie may flip one
    assert max(lengths) == 8 and sum(lengths) / len(lengths) > 4
