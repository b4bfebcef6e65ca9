"""normed_linear (RMSNorm(x + delta) @ W^T in one launch) against the PyTorch norm and a float64
GEMM; s and h against the norm kernel's, bit for bit where the statistics agree."""

from __future__ import annotations

import pytest
import torch

from ddtree.models.fused_norm import rms_norm
from ddtree.models.norm import rms_norm_reference
from ddtree.models.normed_linear import normed_linear
from ddtree.models.skinny import MAX_ROWS


def inputs(rows, depth, cols, dtype, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, depth, generator=gen).to(dtype)
    delta = torch.randn(rows, depth, generator=gen).to(dtype)
    norm_w = (1 + 0.1 * torch.randn(depth, generator=gen)).to(dtype)
    weight = (torch.randn(cols, depth, generator=gen) / depth**0.5).to(dtype)
    return [t.to(device) for t in (x, delta, norm_w, weight)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("rows,depth,cols,with_delta", [(1, 96, 40, True), (3, 600, 70, True), (MAX_ROWS, 64, 17, False)])
def test_matches_norm_then_linear(rows, depth, cols, with_delta, dtype, kernel_device):
    x, delta, norm_w, weight = inputs(rows, depth, cols, dtype, kernel_device, seed=rows)
    out, total, h = normed_linear(x, delta if with_delta else None, norm_w, 1e-6, weight, want_h=True)
    s = (x.cpu() + delta.cpu()) if with_delta else x.cpu()
    want_h = rms_norm_reference(s, norm_w.cpu(), 1e-6)
    if with_delta:  # against the norm kernel on the same device (the interpreter truncates to bf16)
        kernel_sum, _ = rms_norm(x, norm_w, 1e-6, delta)
        assert torch.equal(total, kernel_sum), "s must be x + delta rounded once, as the norm kernel stores it"
    else:
        assert total is None
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
    assert float((h.cpu().double() - want_h.double()).norm() / want_h.double().norm()) < tol
    want = want_h.double() @ weight.cpu().double().t()
    assert not torch.isnan(out).any()
    assert float((out.cpu().double() - want).norm() / want.norm()) < tol


def test_float32_logits_and_no_h(kernel_device):
    x, delta, norm_w, weight = inputs(2, 128, 24, torch.bfloat16, kernel_device, seed=5)
    out, total, h = normed_linear(x, delta, norm_w, 1e-5, weight, out_dtype=torch.float32)
    assert out.dtype == torch.float32 and h is None and total.dtype == torch.bfloat16
    normed = rms_norm_reference(x.cpu() + delta.cpu(), norm_w.cpu(), 1e-5)
    want = normed.double() @ weight.cpu().double().t()
    assert float((out.cpu().double() - want).norm() / want.norm()) < 1e-2


def test_rejects_bad_inputs(kernel_device):
    x, delta, norm_w, weight = inputs(2, 32, 8, torch.bfloat16, kernel_device)
    with pytest.raises(ValueError, match=f"M <= {MAX_ROWS}"):
        normed_linear(torch.zeros(MAX_ROWS + 1, 32, dtype=torch.bfloat16, device=kernel_device), None, norm_w, 1e-6, weight)
    with pytest.raises(ValueError, match=r"weight must be \[N, K=32\]"):
        normed_linear(x, delta, norm_w, 1e-6, weight[:, :16])
    with pytest.raises(ValueError, match="delta must be"):
        normed_linear(x, delta[:1], norm_w, 1e-6, weight)
    with pytest.raises(ValueError, match="norm_weight must be torch.bfloat16"):
        normed_linear(x, delta, norm_w.float(), 1e-6, weight)
