"""fused_moe(unsummed=True): the expert rows before their sum, summed by the next RMSNorm's kernel
(one launch fewer per MoE layer in a decode step). The norm's sum must give exactly the bits of
fused_moe's own sum, through rms_norm and through the RMSNorm module's two paths."""

from __future__ import annotations

import pytest
import torch

from ddtree.models.fused_moe import ExpertRows, fused_moe
from ddtree.models.fused_norm import rms_norm
from ddtree.models.norm import RMSNorm

from .test_fused_moe import Case, make_inputs, make_shared


@pytest.mark.parametrize("tokens,num_shared", [(1, 2), (5, 1), (4, 0)])  # one token: the direct mode
def test_norm_of_unsummed_rows_equals_norm_of_their_sum(tokens, num_shared, kernel_device):
    case = Case(tokens, 3, 7, 40, 24, seed=30 + tokens)
    x, w_gate_up, w_down, weights, ids = make_inputs(case, torch.bfloat16, kernel_device)
    shared = make_shared(case, num_shared, torch.bfloat16, kernel_device) if num_shared else None
    summed = fused_moe(x, w_gate_up, w_down, weights, ids, shared=shared)
    rows = fused_moe(x, w_gate_up, w_down, weights, ids, shared=shared, unsummed=True)
    assert isinstance(rows, ExpertRows) and (rows.tokens, rows.top_k, rows.num_shared) == (tokens, 3, num_shared)
    assert torch.equal(rows.summed(), summed)

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


def test_rows_that_do_not_match_x_are_rejected(kernel_device):
    case = Case(3, 2, 5, 40, 24, seed=6)
    x, w_gate_up, w_down, weights, ids = make_inputs(case, torch.bfloat16, kernel_device)
    rows = fused_moe(x, w_gate_up, w_down, weights, ids, unsummed=True)
    weight = torch.ones(40, dtype=torch.bfloat16, device=kernel_device)
    with pytest.raises(ValueError, match="delta's expert rows must sum to x's 2 rows of 40"):
        rms_norm(torch.zeros(2, 40, dtype=torch.bfloat16, device=kernel_device), weight, 1e-6, rows)
    with pytest.raises(ValueError, match="in torch.float32, got 3 tokens of 40 in torch.bfloat16"):
        rms_norm(torch.zeros(3, 40, device=kernel_device), weight.float(), 1e-6, rows)
