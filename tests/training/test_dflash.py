"""The DFlash training forward equals the inference drafter block by block, and the loss pieces
pick the right target rows."""

import torch

from ddtree.models import Drafter, DrafterConfig, TargetConfig, random_target
from training.dflash import (block_mask, distill_loss, draft_block_logits, position_weights, sample_anchors,
                             teacher_for_blocks)

from ..engine.pairs import drafter_config
from ..models.checkpoints import tiny_config


def _pair(block_size=4, seed=0):
    target = random_target(TargetConfig.from_dict(tiny_config().to_dict()), dtype=torch.float32, seed=seed, std=0.2)
    torch.manual_seed(seed + 1)
    drafter = Drafter(DrafterConfig.from_dict(drafter_config(96, block_size)))
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.2 * torch.randn_like(p))
    return target, drafter.eval()


def test_training_forward_equals_inference_per_anchor():
    target, drafter = _pair(block_size=5)
    gen = torch.Generator().manual_seed(3)
    b, t = 2, 23
    ids = torch.randint(2, 95, (b, t), generator=gen)
    with torch.no_grad():
        _, feats = target(ids, hidden_layers=drafter.cfg.target_layer_ids)
        features = torch.cat(feats, -1)
        anchors = torch.tensor([[1, 6, 7, 18], [2, 3, 11, 15]])  # includes the first and last valid anchors
        got = draft_block_logits(drafter, target, ids, features, anchors)
        assert got.shape == (b, 4, 4, 96)
        for i in range(b):
            for k, a in enumerate(anchors[i].tolist()):
                cache = drafter.new_cache(1, t + 8)
                drafter.append_context(cache, features[i : i + 1, :a], torch.tensor([a]))
                want = drafter.draft_logits(target, ids[i : i + 1, a], cache)[0]
                torch.testing.assert_close(got[i, k], want, rtol=1e-4, atol=1e-4)


def test_block_mask_sees_context_before_anchor_and_own_block():
    mask = block_mask(torch.tensor([[2, 5]]), seq_len=6, block_size=3)[0, 0]
    assert mask.shape == (6, 12)
    want_first = [1, 1, 0, 0, 0, 0] + [1, 1, 1, 0, 0, 0]
    want_second = [1, 1, 1, 1, 1, 0] + [0, 0, 0, 1, 1, 1]
    assert mask[:3].tolist() == [[bool(v) for v in want_first]] * 3
    assert mask[3:].tolist() == [[bool(v) for v in want_second]] * 3


def test_teacher_rows_and_loss():
    logits = torch.randn(1, 10, 7)
    teacher = teacher_for_blocks(logits, torch.tensor([[2, 5]]), block_size=4)
    assert torch.equal(teacher[0, 0], logits[0, 2:5]) and torch.equal(teacher[0, 1], logits[0, 5:8])
    w = position_weights(4, gamma=2.0)
    torch.testing.assert_close(w, torch.exp(-torch.tensor([0.0, 0.5, 1.0])))
    # a student equal to the teacher reaches the teacher's entropy, and anything else costs more
    student = teacher.clone().requires_grad_(True)
    best = distill_loss(student, teacher, w)
    entropy = -(teacher.softmax(-1) * teacher.log_softmax(-1)).sum(-1)
    torch.testing.assert_close(best, (entropy * w).sum(-1).mean() / w.sum())
    assert distill_loss(teacher + torch.randn_like(teacher), teacher, w) > best


def test_anchors_distinct_sorted_in_range():
    gen = torch.Generator().manual_seed(0)
    anchors = sample_anchors(4, 12, 40, 16, gen)
    assert anchors.shape == (4, 12)
    assert (anchors >= 1).all() and (anchors <= 40 - 16).all()
    assert (anchors.diff(dim=1) > 0).all()


def test_dense_training_moe_equals_the_grouped_moe():
    from ddtree.models.layers import MoE
    from training.moe_dense import dense_moe_forward

    target = random_target(TargetConfig.from_dict(tiny_config().to_dict()), dtype=torch.float32, seed=4, std=0.3)
    moe = target.layers[1].mlp
    assert isinstance(moe, MoE)
    with torch.no_grad():
        moe.gate.e_score_correction_bias.normal_(0, 0.2)
    x = torch.randn(3, 11, 64, generator=torch.Generator().manual_seed(5))
    want_ids, got_ids = [], []
    want = moe(x, want_ids)
    got = dense_moe_forward(moe, x, got_ids)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(got_ids[0], want_ids[0])
