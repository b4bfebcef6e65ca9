"""Training helpers: the router bias accumulates DeepSeek-V3's balancing steps (it once was reset
by the optimizer's master copy every step), and MasterAdamW leaves gradient-less parameters alone."""

import torch
import torch.nn.functional as F

from ddtree.models import TargetConfig, random_target
from training.balance import RouterBalance
from training.loop import MasterAdamW

from ..models.checkpoints import tiny_config


def _target(dtype=torch.float32):
    target = random_target(TargetConfig.from_dict(tiny_config().to_dict()), dtype=dtype, seed=3, std=0.3)
    target.train()
    for p in target.parameters():
        p.requires_grad_(True)
    return target


def test_bias_accumulates_through_training_steps():
    target = _target(torch.bfloat16)
    balance = RouterBalance(target, rate=1e-3)  # before the optimizer, as train_target.py does
    opt = MasterAdamW(target.parameters(), lr=1e-3, weight_decay=0.1)
    assert all(not m.gate.e_score_correction_bias.requires_grad for m in balance.moes)
    ids = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(0))
    steps = 20
    for _ in range(steps):
        logits, _ = target(ids[:, :-1])
        F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten()).backward()
        opt.step(1e-3)
        balance.update()
    for moe, bias in zip(balance.moes, balance.bias):
        # every step moves each bias by exactly +-rate (or 0 at the mean): 20 steps reach past one step
        assert bias.abs().max() > 5e-3
        assert torch.all((bias / 1e-3 - (bias / 1e-3).round()).abs() < 1e-3)
        torch.testing.assert_close(moe.gate.e_score_correction_bias.float(), bias.to(torch.bfloat16).float())


def test_master_adamw_leaves_parameters_without_grad_alone():
    a, b = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2, 2))
    opt = MasterAdamW([a, b], lr=0.1, weight_decay=0.0)
    (b.sum() * 2).backward()
    with torch.no_grad():
        a += 5.0  # changed outside the optimizer, as the balancing bias is
    opt.step(0.1)
    assert torch.equal(a.detach(), torch.full((3,), 6.0))
    assert (b.detach() < 1).all()
