"""ops/drafter_qkv.py: the drafter's query / key norm and rope and its cache writes in one launch,
against its PyTorch reference, which is checked against the layers it replaces. Outputs and caches
start as NaN so that an unwritten element shows (and one written where it should not be); the
projections are a slice of a wider NaN-padded buffer so that a read past its heads shows."""

from __future__ import annotations

import pytest
import torch

from ddtree.models.layers import rotary_cos_sin, rotate
from ddtree.ops.drafter_qkv import drafter_qkv, drafter_qkv_reference
from ddtree.ops.norm import rms_norm_reference

# Both paths round at the same six points; the norm's sum order and (interpreted) truncation to
# bf16 move a rounding by an ulp, which the rotation's differences carry at the inputs' magnitude
# (|x| up to ~8 here: a bf16 ulp of 1/32).
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=0, atol=0.125),
       torch.float16: dict(rtol=0, atol=0.016)}


def projections(b, s, heads, d, dtype, device, seed):
    """[b, s, heads, d] random, as the first heads of a [b, s, heads + 2, d] buffer of NaN."""
    gen = torch.Generator().manual_seed(seed)
    buf = torch.full((b, s, heads + 2, d), float("nan"))
    buf[..., :heads, :] = torch.randn((b, s, heads, d), generator=gen) * 2
    return buf.to(dtype=dtype, device=device)[..., :heads, :]


def tables(b, s, d, dtype, device, seed):
    positions = torch.randint(0, 5000, (b, s), generator=torch.Generator().manual_seed(seed))
    inv_freq = 1.0 / 1e6 ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    return [t.to(device) for t in rotary_cos_sin(positions, inv_freq, 1.0, dtype)]


def norm_weights(d, dtype, device):
    gen = torch.Generator().manual_seed(d)
    return tuple((1 + 0.3 * torch.randn(d, generator=gen)).to(dtype=dtype, device=device) for _ in range(2))


def caches(rows, capacity, kv_heads, d, dtype, device):
    return [torch.full((rows, capacity, kv_heads, d), float("nan"), dtype=dtype, device=device) for _ in range(2)]


@pytest.mark.parametrize("dtype,cache_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                               (torch.float16, torch.float16), (torch.bfloat16, torch.float32)], ids=str)
@pytest.mark.parametrize("b,s,q_heads,kv_heads,d", [(1, 16, 4, 2, 16), (3, 5, 16, 8, 128), (2, 3, 0, 1, 32),
                                                    (2, 4, 3, 1, 8)])
def test_matches_reference(b, s, q_heads, kv_heads, d, dtype, cache_dtype, kernel_device):
    qkv = projections(b, s, q_heads + 2 * kv_heads, d, dtype, kernel_device, seed=q_heads + d)
    w = norm_weights(d, dtype, kernel_device)
    cos, sin = tables(b, s, d, dtype, kernel_device, seed=d)
    rows = torch.tensor([[(r + 1) % (b + 1)] * s for r in range(b)], device=kernel_device)  # not 0 .. B - 1
    slots = (torch.arange(s) + 3 * torch.arange(b)[:, None]).to(kernel_device)
    k_cache, v_cache = caches(b + 1, 3 * b + s + 2, kv_heads, d, cache_dtype, kernel_device)
    want_k, want_v = (t.cpu() for t in caches(b + 1, 3 * b + s + 2, kv_heads, d, cache_dtype, "cpu"))
    q = drafter_qkv(qkv, q_heads, w, cos, sin, 1e-6, k_cache, v_cache, rows, slots)
    want_q = drafter_qkv_reference(qkv.cpu(), q_heads, tuple(t.cpu() for t in w), cos.cpu(), sin.cpu(), 1e-6,
                                   want_k, want_v, rows.cpu(), slots.cpu())
    if q_heads:
        assert not q.isnan().any()
        torch.testing.assert_close(q.cpu(), want_q, **TOL[dtype])
    else:
        assert q is None and want_q is None
    assert torch.equal(k_cache.isnan().cpu(), want_k.isnan()) and torch.equal(v_cache.isnan().cpu(), want_v.isnan())
    written = ~want_k.isnan()
    torch.testing.assert_close(k_cache.cpu()[written], want_k[written], **TOL[dtype])
    keys = k_cache.cpu()[written]  # rounded to the projections' dtype, as the reference's, before a wider cache
    assert torch.equal(keys, keys.to(dtype).to(cache_dtype))
    assert torch.equal(v_cache.cpu()[written], want_v[written])  # values are copied as they are


def test_reference_is_the_layers_op_by_op():
    """The reference is what the drafter ran before: q_norm then rotate, k_norm then rotate, the
    keys and values written by index."""
    qkv = projections(2, 4, 8, 16, torch.bfloat16, "cpu", seed=1)
    w = norm_weights(16, torch.bfloat16, "cpu")
    cos, sin = tables(2, 4, 16, torch.bfloat16, "cpu", seed=2)
    rows, slots = torch.arange(2)[:, None].expand(2, 4), torch.tensor([[0, 1, 2, 3], [5, 6, 7, 8]])
    k_cache, v_cache = caches(2, 9, 2, 16, torch.bfloat16, "cpu")
    q = drafter_qkv_reference(qkv, 4, w, cos, sin, 1e-6, k_cache, v_cache, rows, slots)
    assert torch.equal(q, rotate(rms_norm_reference(qkv[..., :4, :], w[0], 1e-6), cos, sin, interleave=False))
    assert torch.equal(k_cache[rows, slots], rotate(rms_norm_reference(qkv[..., 4:6, :], w[1], 1e-6), cos, sin, interleave=False))
    assert torch.equal(v_cache[rows, slots], qkv[..., 6:, :])


def test_slots_outside_the_capacity_are_not_written(kernel_device):
    qkv = projections(1, 4, 4, 8, torch.float32, kernel_device, seed=3)
    w = norm_weights(8, torch.float32, kernel_device)
    cos, sin = tables(1, 4, 8, torch.float32, kernel_device, seed=4)
    k_cache, v_cache = caches(2, 3, 1, 8, torch.float32, kernel_device)
    rows, slots = torch.zeros(1, 4, dtype=torch.int64, device=kernel_device), torch.tensor([[1, 2, 3, -1]], device=kernel_device)
    drafter_qkv(qkv, 2, w, cos, sin, 1e-6, k_cache, v_cache, rows, slots)
    for cache in (k_cache, v_cache):
        assert not cache[0, 1:].isnan().any() and cache[0, 0].isnan().all() and cache[1].isnan().all()


def test_bad_input_is_named():
    qkv = torch.zeros(2, 3, 4, 8)
    w = (torch.ones(8), torch.ones(8))
    cos = sin = torch.zeros(2, 3, 4)
    kc, vc = torch.zeros(2, 5, 1, 8), torch.zeros(2, 5, 1, 8)
    rows = slots = torch.zeros(2, 3, dtype=torch.int64)
    cases = [((torch.zeros(2, 3, 4, 7), 2, w, cos, sin, 1e-6, kc, vc, rows, slots), "even d"),
             ((qkv, 1, w, cos, sin, 1e-6, kc, vc, rows, slots), "q_heads=1"),
             ((qkv, 2, (torch.ones(8), torch.ones(6)), cos, sin, 1e-6, kc, vc, rows, slots), r"weights\[1\] must be \[8\]"),
             ((qkv, 2, w, torch.zeros(2, 4), sin, 1e-6, kc, vc, rows, slots), r"cos must be \[2, 3, 4\]"),
             ((qkv, 2, w, cos, sin, 1e-6, torch.zeros(2, 5, 2, 8), vc, rows, slots), r"k_cache must be \[R, capacity, 1, 8\]"),
             ((qkv, 2, w, cos, sin, 1e-6, kc, vc.double(), rows, slots), "v_cache must be"),
             ((qkv, 2, w, cos, sin, 1e-6, kc, vc, rows.int(), slots), r"rows must be int64 \[2, 3\]")]
    for args, match in cases:
        with pytest.raises(ValueError, match=match):
            drafter_qkv(*args)
