"""The fused MoE's decode-step shortcuts. The direct mode for one token (no alignment launch) must
give the aligned path's bits. fused_moe(unsummed=True) leaves the sum over experts to the next
RMSNorm's kernel (one launch fewer per MoE layer): the norm's sum must give exactly the bits of
fused_moe's own sum, through rms_norm, the RMSNorm module's two paths and a whole forward."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from ddtree.models import fused_moe as fused_moe_module
from ddtree.models import moe as moe_module
from ddtree.models import random_target
from ddtree.models.fused_moe import ExpertRows, SharedExperts, Workspace, fused_moe
from ddtree.models.fused_norm import rms_norm
from ddtree.models.norm import RMSNorm
from ddtree.models.paged import ForwardMeta
from ddtree.models.switches import set_kernel_paths

from .test_fused_moe import POISON_INT, TOL, Case, assert_close, make_inputs, make_shared, moe_reference
from .test_fused_target import PAGE, chain_meta, tiny


@pytest.mark.parametrize("num_shared", [0, 2])
def test_direct_mode_for_one_token_equals_the_aligned_path(num_shared, kernel_device, monkeypatch):
    """One token: the kernels skip the alignment (one program per choice, the expert read from ids;
    the alignment's buffers stay as poisoned) and give the aligned path's bits, within the float64
    reference's tolerance."""
    case = Case(1, 3, 7, 40, 24, seed=21)
    x, w_gate_up, w_down, weights, ids = make_inputs(case, torch.bfloat16, kernel_device)
    shared = make_shared(case, num_shared, torch.bfloat16, kernel_device) if num_shared else None
    outs = {}
    for direct in (0, 1):
        monkeypatch.setattr(fused_moe_module, "DIRECT_MAX_TOKENS", direct)
        ws = Workspace.empty(1, case.top_k, case.experts, case.hidden, case.inter, torch.bfloat16, kernel_device,
                             num_shared=num_shared)
        ws.sorted_pairs.fill_(POISON_INT)
        ws.block_expert.fill_(POISON_INT)
        for buf in (ws.h, ws.y):
            buf.fill_(float("nan"))
        outs[direct] = fused_moe(x, w_gate_up, w_down, weights, ids, shared=shared, workspace=ws)
        assert not torch.isnan(ws.y).any(), "a choice's row was not written"
        aligned = bool((ws.block_expert != POISON_INT).any())
        assert aligned == (not direct), "the alignment runs exactly when the direct mode is off"
    assert torch.equal(outs[0], outs[1])
    cpu = SharedExperts(shared.gate.cpu(), shared.up.cpu(), shared.down.cpu()) if shared is not None else None
    assert_close(outs[1], moe_reference(x.cpu(), w_gate_up.cpu(), w_down.cpu(), weights.cpu(), ids.cpu(), cpu),
                 TOL[torch.bfloat16])


@pytest.mark.parametrize("tokens,num_shared", [(1, 2), (5, 1), (5, 2), (4, 0)])  # one token: the direct mode
def test_norm_of_unsummed_rows_equals_norm_of_their_sum(tokens, num_shared, kernel_device):
    case = Case(tokens, 3, 7, 40, 24, seed=30 + tokens)
    x, w_gate_up, w_down, weights, ids = make_inputs(case, torch.bfloat16, kernel_device)
    shared = make_shared(case, num_shared, torch.bfloat16, kernel_device) if num_shared else None
    summed = fused_moe(x, w_gate_up, w_down, weights, ids, shared=shared)
    rows = fused_moe(x, w_gate_up, w_down, weights, ids, shared=shared, unsummed=True)
    assert isinstance(rows, ExpertRows) and (rows.tokens, rows.top_k, rows.num_shared) == (tokens, 3, num_shared)

    gen = torch.Generator().manual_seed(tokens)
    residual = torch.randn(tokens, case.hidden, generator=gen).to(torch.bfloat16).to(kernel_device)
    weight = (1 + 0.1 * torch.randn(case.hidden, generator=gen)).to(torch.bfloat16).to(kernel_device)
    want_sum, want = rms_norm(residual, weight, 1e-6, summed)
    got_sum, got = rms_norm(residual, weight, 1e-6, rows)
    assert torch.equal(got_sum, want_sum) and torch.equal(got, want)

    norm = RMSNorm(case.hidden, 1e-6).to(device=kernel_device, dtype=torch.bfloat16)
    norm.weight.data.copy_(weight)
    for fused in (True, False):  # the kernel sums the rows; PyTorch gets summed() first
        norm.fused = fused
        with torch.no_grad():
            got_sum, got = norm(residual, rows)
            ref_sum, ref = norm(residual, summed)
        assert torch.equal(got_sum, ref_sum) and torch.equal(got, ref), fused


def test_no_experts_give_zero_rows(kernel_device):
    case = Case(2, 0, 4, 40, 24, seed=5)
    x, w_gate_up, w_down, weights, ids = make_inputs(case, torch.float32, kernel_device)
    rows = fused_moe(x, w_gate_up, w_down, weights, ids, unsummed=True)
    assert torch.equal(rows.summed(), torch.zeros(2, 40, device=kernel_device))
    residual = torch.randn(2, 40, generator=torch.Generator().manual_seed(1)).to(kernel_device)
    weight = torch.ones(40, device=kernel_device)
    got_sum, got = rms_norm(residual, weight, 1e-6, rows)
    want_sum, want = rms_norm(residual, weight, 1e-6, torch.zeros_like(residual))
    assert torch.equal(got_sum, want_sum) and torch.equal(got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_forward_with_the_sum_in_the_norm_equals_one_without(dtype, monkeypatch, kernel_device):
    """Every kernel path forced on a three-layer target (a dense layer, then two MoE layers with a
    shared expert): the MoE's rows go to the next layer's norm, the final norm, or expert_sum (a
    captured layer, the logit rows). Logits, captured layers and caches must be the bits of the same
    forward with the sum in its own launch (UNSUMMED_MAX_TOKENS = 0)."""
    cfg = dataclasses.replace(tiny(None, True), num_hidden_layers=3)
    model = random_target(cfg, dtype=dtype, std=0.1, device=kernel_device)
    set_kernel_paths(model, "kernels")
    meta = ForwardMeta(**{k: v.to(kernel_device) for k, v in vars(chain_meta([0, 0], 3, [3, 2])).items()})
    ids = torch.randint(0, 64, (2, 3), generator=torch.Generator().manual_seed(4)).to(kernel_device)
    unsummed = []
    real = moe_module.fused_moe
    monkeypatch.setattr(moe_module, "fused_moe", lambda *a, **kw: unsummed.append(kw.get("unsummed", False)) or real(*a, **kw))
    cases = [(layers, rows) for layers in ((0, 2), (0,)) for rows in (None, torch.tensor([2, 1], device=kernel_device))]
    results = {}
    for limit in (16, 0):
        monkeypatch.setattr(moe_module, "UNSUMMED_MAX_TOKENS", limit)
        for i, (layers, logit_rows) in enumerate(cases):
            caches = model.new_cache(6, PAGE)
            with torch.no_grad():
                logits, hidden = model.forward_paged(ids, meta, caches, hidden_layers=layers, logit_rows=logit_rows)
            results[limit, i] = (logits, hidden, caches)
    assert unsummed == [True] * 8 + [False] * 8, "the MoE layers must take the unsummed path exactly when allowed"
    for i in range(len(cases)):
        (logits, hidden, caches), (want, want_hidden, want_caches) = results[16, i], results[0, i]
        assert torch.equal(logits, want), cases[i]
        assert all(torch.equal(g, w) for g, w in zip(hidden, want_hidden)), cases[i]
        assert all(torch.equal(g, w) for g, w in zip(caches, want_caches)), cases[i]


def test_rows_that_do_not_match_x_are_rejected(kernel_device):
    case = Case(3, 2, 5, 40, 24, seed=6)
    x, w_gate_up, w_down, weights, ids = make_inputs(case, torch.bfloat16, kernel_device)
    rows = fused_moe(x, w_gate_up, w_down, weights, ids, unsummed=True)
    weight = torch.ones(40, dtype=torch.bfloat16, device=kernel_device)
    with pytest.raises(ValueError, match="delta's expert rows must sum to x's 2 rows of 40"):
        rms_norm(torch.zeros(2, 40, dtype=torch.bfloat16, device=kernel_device), weight, 1e-6, rows)
    with pytest.raises(ValueError, match="in torch.float32, got 3 tokens of 40 in torch.bfloat16"):
        rms_norm(torch.zeros(3, 40, device=kernel_device), weight.float(), 1e-6, rows)
