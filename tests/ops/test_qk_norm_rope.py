"""ops/qk_norm_rope.py: the per-head norm and rotate-half rope of the drafter's queries and keys in
one launch, against its PyTorch reference and against the layers it replaces. Outputs start as
NaN so that an unwritten element shows; the inputs are heads of a wider buffer whose other heads
(the values' columns) are NaN, so that a read past the last head shows and an in-place run must
leave them alone."""

from __future__ import annotations

import pytest
import torch

from ddtree.models.layers import rotary_cos_sin, rotate
from ddtree.ops.norm import rms_norm_reference
from ddtree.ops.qk_norm_rope import qk_norm_rope, qk_norm_rope_reference

# Both paths round at the same six points; the norm's sum order and (interpreted) truncation to
# bf16 move a rounding by an ulp, which the rotation's differences carry at the inputs' magnitude
# (|x| up to ~8 here: a bf16 ulp of 1/32).
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=0, atol=0.125),
       torch.float16: dict(rtol=0, atol=0.016)}


def joint(lead: tuple[int, ...], heads: int, extra: int, d: int, dtype, device, seed: int) -> torch.Tensor:
    """[*lead, heads + extra, d] with random heads first and NaN after (the values' columns)."""
    gen = torch.Generator().manual_seed(seed)
    buf = torch.full((*lead, heads + extra, d), float("nan"))
    buf[..., :heads, :] = torch.randn((*lead, heads, d), generator=gen) * 2
    return buf.to(dtype=dtype, device=device)


def tables(lead: tuple[int, ...], d: int, dtype, device, seed: int):
    positions = torch.randint(0, 5000, lead, generator=torch.Generator().manual_seed(seed))
    inv_freq = 1.0 / 1e6 ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    return [t.to(device) for t in rotary_cos_sin(positions, inv_freq, 1.0, dtype)]


def weights(d: int, dtype, device):
    gen = torch.Generator().manual_seed(d)
    return tuple((1 + 0.3 * torch.randn(d, generator=gen)).to(dtype=dtype, device=device) for _ in range(2))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("lead,heads,split,d", [((1, 16), 6, 4, 16), ((3, 5), 24, 16, 128), ((7,), 3, 3, 32),
                                                ((2, 2), 5, 0, 8)])
def test_matches_reference(lead, heads, split, d, dtype, kernel_device):
    buf = joint(lead, heads, 2, d, dtype, kernel_device, seed=heads + d)
    x = buf[..., :heads, :]
    w = weights(d, dtype, kernel_device)
    cos, sin = tables(lead, d, dtype, kernel_device, seed=d)
    out = torch.full(x.shape, float("nan"), dtype=dtype, device=kernel_device)
    got = qk_norm_rope(x, w, split, cos, sin, 1e-6, out=out)
    want = qk_norm_rope_reference(x.cpu(), tuple(t.cpu() for t in w), split, cos.cpu(), sin.cpu(), 1e-6)
    assert got is out and not got.isnan().any()
    torch.testing.assert_close(got.cpu(), want, **TOL[dtype])
    # in place over the joint buffer's first heads: the values' heads stay NaN
    in_place = qk_norm_rope(x, w, split, cos, sin, 1e-6, out=x)
    assert in_place.data_ptr() == buf.data_ptr()
    torch.testing.assert_close(buf[..., :heads, :].cpu(), got.cpu(), rtol=0, atol=0)
    assert buf[..., heads:, :].isnan().all()


def test_reference_is_the_layers_op_by_op():
    """The reference is what the drafter ran before: q_norm then rotate, k_norm then rotate."""
    x = joint((2, 4), 6, 0, 16, torch.bfloat16, "cpu", seed=1)
    w = weights(16, torch.bfloat16, "cpu")
    cos, sin = tables((2, 4), 16, torch.bfloat16, "cpu", seed=2)
    want = torch.cat([rotate(rms_norm_reference(x[..., :4, :], w[0], 1e-6), cos, sin, interleave=False),
                      rotate(rms_norm_reference(x[..., 4:, :], w[1], 1e-6), cos, sin, interleave=False)], dim=-2)
    assert torch.equal(qk_norm_rope_reference(x, w, 4, cos, sin, 1e-6), want)


def test_bad_input_is_named():
    x = torch.zeros(2, 3, 8)
    w = (torch.ones(8), torch.ones(8))
    cos = sin = torch.zeros(2, 4)
    cases = [((torch.zeros(2, 3, 7), w, 1, cos, sin), "even d"),
             ((x, w, 4, cos, sin), r"split must be in \[0, H=3\]"),
             ((x, (torch.ones(8), torch.ones(6)), 1, cos, sin), r"weights\[1\] must be \[8\]"),
             ((x, w, 1, torch.zeros(3, 4), sin), r"cos must be \[2, 4\]"),
             ((x, (w[0].double(), w[1]), 1, cos, sin), r"weights\[0\] must be \[8\] torch.float32")]
    for args, match in cases:
        with pytest.raises(ValueError, match=match):
            qk_norm_rope(*args, 1e-6)
    with pytest.raises(ValueError, match="out's tokens must flatten"):
        qk_norm_rope(x[None].expand(2, 2, 3, 8), w, 1, cos[None].expand(2, 2, 4), sin[None].expand(2, 2, 4), 1e-6,
                     out=torch.zeros(2, 2, 3, 8).transpose(0, 1))
