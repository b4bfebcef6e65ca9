"""absorbed_query (one launch) against the three launches it replaces: W_UK through skinny_matmul,
rotary_into and write_latent_entries. The cache starts as NaN: only the mapped slots may change."""

from __future__ import annotations

import pytest
import torch

from ddtree.ops.mla import absorbed_query
from ddtree.ops.mla import rotary_into, write_latent_entries
from ddtree.ops.gemm import MAX_ROWS, skinny_matmul


def make(rows, heads, nope, latent, rope, dtype, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(rows, heads, nope + rope + 8, generator=gen)[..., : nope + rope]  # a strided view, as MLA's
    w_kv_b = torch.randn(heads, nope + 16, latent, generator=gen) / nope**0.5
    kv = torch.randn(rows, latent + rope, generator=gen)
    norm_w = 1 + 0.1 * torch.randn(latent, generator=gen)
    angle = torch.rand(rows, rope // 2, generator=gen) * 6
    slots = torch.randperm(4 * 8, generator=gen)[:rows]
    cache = torch.full((4, 8, latent + rope), float("nan"))
    on = lambda t: t.to(device=device, dtype=dtype)  # noqa: E731
    return (on(q), on(w_kv_b)[:, :nope], on(kv), on(norm_w), on(angle.cos()), on(angle.sin()), on(cache),
            slots.to(device))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("rows,heads,nope,latent,rope,interleave", [
    (1, 3, 24, 40, 8, True), (MAX_ROWS, 2, 16, 64, 16, False), (5, 4, 40, 72, 8, True),  # 72: two column tiles + a tail
])
def test_equals_the_three_launches(rows, heads, nope, latent, rope, interleave, dtype, kernel_device):
    q, w_uk, kv, norm_w, cos, sin, cache, slots = make(rows, heads, nope, latent, rope, dtype, kernel_device, rows)
    want_cache = cache.clone()
    write_latent_entries(kv, norm_w, 1e-6, cos, sin, want_cache.view(-1, latent + rope), slots, interleave)
    want = torch.full((rows, heads, latent + rope), float("nan"), dtype=dtype, device=kernel_device)
    rotary_into(q[..., nope:], cos, sin, want[..., latent:], interleave)
    skinny_matmul(q[..., :nope].transpose(0, 1), w_uk, want[..., :latent].transpose(0, 1), block_n=32)
    got = absorbed_query(q, w_uk, kv, norm_w, 1e-6, cos, sin, cache.view(-1, latent + rope), slots, interleave)
    assert not torch.isnan(got).any(), "a query element was not written"
    assert torch.equal(got[..., latent:], want[..., latent:]), "the rotary part must match rotary_into bit for bit"
    torch.testing.assert_close(got[..., :latent], want[..., :latent], rtol=1e-2 if dtype == torch.bfloat16 else 1e-5,
                               atol=1e-2 if dtype == torch.bfloat16 else 1e-5)
    assert torch.equal(cache.isnan(), want_cache.isnan()), "only the mapped slots may be written"
    assert torch.equal(cache.nan_to_num(0.0), want_cache.nan_to_num(0.0)), "entries must match write_latent_entries"


def test_rejects_bad_inputs(kernel_device):
    q, w_uk, kv, norm_w, cos, sin, cache, slots = make(2, 3, 24, 40, 8, torch.float32, kernel_device)
    flat = cache.view(-1, 48)
    with pytest.raises(ValueError, match=r"w_uk must be torch.float32 \[3, 24, 40\]"):
        absorbed_query(q, w_uk[:, :20], kv, norm_w, 1e-6, cos, sin, flat, slots, True)
    with pytest.raises(ValueError, match=r"q must be torch.float32 \[T=2"):
        absorbed_query(q[:1], w_uk, kv, norm_w, 1e-6, cos, sin, flat, slots, True)
    with pytest.raises(ValueError, match="slot_mapping must be contiguous int64"):
        absorbed_query(q, w_uk, kv, norm_w, 1e-6, cos, sin, flat, slots.int(), True)
