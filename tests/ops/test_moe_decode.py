"""The fused MoE's decode-step shortcut: the direct mode for one token (no alignment launch) must
give the aligned path's bits; the MoE layer passes its policy's limit down."""

from __future__ import annotations

import pytest
import torch

from ddtree.models import layers as target_module
from ddtree.ops import KERNELS
from ddtree.ops.moe import SharedExperts, Workspace, fused_moe

from .test_moe import POISON_INT, TOL, Case, assert_close, make_inputs, make_moe, make_shared, moe_reference


@pytest.mark.parametrize("num_shared", [0, 2])
def test_direct_mode_for_one_token_equals_the_aligned_path(num_shared, kernel_device):
    """One token: the kernels skip the alignment (one program per choice, the expert read from ids;
    the alignment's buffers stay as poisoned) and give the aligned path's bits, within the float64
    reference's tolerance."""
    case = Case(1, 3, 7, 40, 24, seed=21)
    x, w_gate_up, w_down, weights, ids = make_inputs(case, torch.bfloat16, kernel_device)
    shared = make_shared(case, num_shared, torch.bfloat16, kernel_device) if num_shared else None
    outs = {}
    for direct in (0, 1):
        ws = Workspace.empty(1, case.top_k, case.experts, case.hidden, case.inter, torch.bfloat16, kernel_device,
                             num_shared=num_shared)
        ws.sorted_pairs.fill_(POISON_INT)
        ws.block_expert.fill_(POISON_INT)
        for buf in (ws.h, ws.y):
            buf.fill_(float("nan"))
        outs[direct] = fused_moe(x, w_gate_up, w_down, weights, ids, shared=shared, workspace=ws, direct_max_tokens=direct)
        assert not torch.isnan(ws.y).any(), "a choice's row was not written"
        aligned = bool((ws.block_expert != POISON_INT).any())
        assert aligned == (not direct), "the alignment runs exactly when the direct mode is off"
    assert torch.equal(outs[0], outs[1])
    cpu = SharedExperts(shared.gate.cpu(), shared.up.cpu(), shared.down.cpu()) if shared is not None else None
    assert_close(outs[1], moe_reference(x.cpu(), w_gate_up.cpu(), w_down.cpu(), weights.cpu(), ids.cpu(), cpu),
                 TOL[torch.bfloat16])


def test_no_experts_give_zeros(kernel_device):
    case = Case(2, 0, 4, 40, 24, seed=5)
    x, w_gate_up, w_down, weights, ids = make_inputs(case, torch.float32, kernel_device)
    out = fused_moe(x, w_gate_up, w_down, weights, ids, out=torch.full_like(x, float("nan")))
    assert torch.equal(out, torch.zeros(2, 40, device=kernel_device))


@pytest.mark.parametrize("limit", [0, 1, 4])
@torch.no_grad()
def test_the_layer_passes_its_policy_down(limit, kernel_device, monkeypatch):
    """The MoE layer gives fused_moe its policy's direct-mode limit and PDL switch, no global."""
    seen = []
    real = target_module.fused_moe
    monkeypatch.setattr(target_module, "fused_moe", lambda *a, **kw: seen.append(kw) or real(*a, **kw))
    moe = make_moe(torch.float32).to(kernel_device)
    moe.policy = KERNELS.but(moe_direct_max_tokens=limit, pdl=limit != 1)
    moe(torch.randn(3, 72, device=kernel_device))
    assert [(kw["direct_max_tokens"], kw["pdl"]) for kw in seen] == [(limit, limit != 1)]
