"""The norm and rotary kernels (ops/norm.py, ops/mla.py) against their PyTorch references:
RMSNorm in the same dtype and in float64, layers.rotate, and MLA's cache entry (norm + rotary +
cast + write). Outputs start as NaN so that an unwritten element shows; inputs are column slices
of NaN-padded buffers so that a read past a row's end shows."""

from __future__ import annotations

import pytest
import torch

from ddtree.models import layers as layers_module
from ddtree.models.layers import RMSNorm, rotary_cos_sin, rotate
from ddtree.ops import KERNELS, KernelPolicy
from ddtree.ops.mla import rotary_into, write_latent_entries
from ddtree.ops.norm import rms_norm, rms_norm_reference

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# Same-dtype reference: float32 differs only in the sum's order; the interpreter truncates
# float32 -> bf16 where torch rounds to nearest (one bf16 ulp, 2^-8 relative).
TOL = {torch.float32: dict(rtol=2e-6, atol=2e-6), torch.bfloat16: dict(rtol=1.6e-2, atol=1.6e-2),
       torch.float16: dict(rtol=2e-3, atol=2e-3)}


def padded(shape: tuple[int, ...], dtype: torch.dtype, device: str, seed: int, scale: float = 1.0) -> torch.Tensor:
    """Random [*shape] as a column slice of a buffer whose extra columns are NaN."""
    gen = torch.Generator().manual_seed(seed)
    wide = torch.full((*shape[:-1], shape[-1] + 9), float("nan"))
    wide[..., : shape[-1]] = torch.randn(shape, generator=gen) * scale
    return wide.to(dtype=dtype, device=device)[..., : shape[-1]]


# ---- RMSNorm ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows,cols", [(1, 64), (7, 40), (33, 200), (3, 1)])
def test_rms_norm_matches_reference(rows, cols, dtype, kernel_device):
    x = padded((rows, cols), dtype, kernel_device, seed=rows + cols, scale=3.0)
    weight = (1 + 0.3 * torch.randn(cols, generator=torch.Generator().manual_seed(cols))).to(dtype=dtype, device=kernel_device)
    out = torch.full((rows, cols), float("nan"), dtype=dtype, device=kernel_device)
    got = rms_norm(x, weight, 1e-6, out=out)
    assert got is out and not got.isnan().any()
    torch.testing.assert_close(got.cpu(), rms_norm_reference(x.cpu(), weight.cpu(), 1e-6), **TOL[dtype])
    want64 = rms_norm_reference(x.cpu().double(), weight.cpu().double(), 1e-6)
    torch.testing.assert_close(got.cpu().double(), want64, **(TOL[dtype] if dtype != torch.float32 else dict(rtol=1e-5, atol=1e-5)))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_residual_add_and_norm(dtype, kernel_device):
    """(x + delta, RMSNorm(x + delta)) on [B, N, D] with a non-power-of-two D; 3-D strided inputs."""
    x = padded((2, 3, 72), dtype, kernel_device, seed=1)
    delta = padded((2, 3, 72), dtype, kernel_device, seed=2)
    weight = torch.rand(72, generator=torch.Generator().manual_seed(3)).to(dtype=dtype, device=kernel_device) + 0.5
    poison = dict(dtype=dtype, device=kernel_device)
    total, y = rms_norm(x, weight, 1e-5, delta, out=torch.full((2, 3, 72), float("nan"), **poison),
                        sum_out=torch.full((2, 3, 72), float("nan"), **poison))
    want_total = x.cpu() + delta.cpu()
    torch.testing.assert_close(total.cpu(), want_total, **TOL[dtype])
    torch.testing.assert_close(y.cpu(), rms_norm_reference(total.cpu(), weight.cpu(), 1e-5), **TOL[dtype])


def test_float32_weight_on_bf16_rows_promotes(kernel_device):
    x = padded((4, 48), torch.bfloat16, kernel_device, seed=5)
    weight = torch.rand(48, device=kernel_device) + 0.5
    got = rms_norm(x, weight, 1e-6)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.cpu(), rms_norm_reference(x.cpu(), weight.cpu(), 1e-6), **TOL[torch.bfloat16])


@pytest.mark.parametrize("change,match", [
    (lambda a: a.update(weight=a["weight"][None]), r"weight must be \[D\]"),
    (lambda a: a.update(x=a["x"][:, :-1]), "x must end in the weight's size 16"),
    (lambda a: a.update(delta=a["x"].double()), "delta must match x"),
    (lambda a: a.update(x=a["x"].int()), "x must be one of"),
    (lambda a: a.update(weight=a["weight"].to("meta")), "weight is on meta"),
    (lambda a: a.update(out=torch.empty(3, 16, dtype=torch.float16)), "out must be a contiguous torch.float32"),
])
def test_rms_norm_rejects_bad_inputs(change, match, kernel_device):
    args = dict(x=torch.randn(3, 16, device=kernel_device), weight=torch.ones(16, device=kernel_device), eps=1e-6)
    change(args)
    with pytest.raises((ValueError, TypeError), match=match):
        rms_norm(**args)


def test_rmsnorm_switch(monkeypatch):
    """CPU default: PyTorch; the "kernels" policy: the kernel, which refuses a forward autograd needs."""
    calls = []
    monkeypatch.setattr(layers_module, "rms_norm", lambda *args, **kw: calls.append(args) or args[0])
    norm = RMSNorm(8, 1e-6)
    x = torch.randn(2, 8)
    with torch.no_grad():
        norm(x)
        assert calls == []
        norm.policy = KERNELS
        norm(x, x)
        assert len(calls) == 1
    with pytest.raises(RuntimeError, match="no backward"):
        norm(x)
    norm.policy = KernelPolicy()
    norm(x).sum().backward()
    assert norm.weight.grad is not None and len(calls) == 1


# ---- rotary -------------------------------------------------------------------------------------------

def cos_sin(rows: int, half: int, dtype: torch.dtype, device: str, factor: float = 1.3):
    positions = torch.randint(0, 500, (rows,), generator=torch.Generator().manual_seed(rows))
    inv_freq = 1.0 / 50.0 ** (torch.arange(half, dtype=torch.float32) / half)
    return tuple(t.to(device) for t in rotary_cos_sin(positions, inv_freq, factor, dtype))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("interleave", [True, False])
@pytest.mark.parametrize("rows,heads,rope", [(1, 1, 8), (5, 3, 12), (9, 2, 64)])
def test_rotary_into_matches_rotate(rows, heads, rope, interleave, dtype, kernel_device):
    """Writes only the rotary slice of a wider, NaN-filled query, from a strided x."""
    x = padded((rows, heads, rope), dtype, kernel_device, seed=rope)
    cos, sin = cos_sin(rows, rope // 2, dtype, kernel_device)
    query = torch.full((rows, heads, 20 + rope), float("nan"), dtype=dtype, device=kernel_device)
    rotary_into(x, cos, sin, query[..., 20:], interleave)
    assert query[..., :20].isnan().all(), "wrote outside out"
    want = rotate(x.cpu()[None], cos.cpu()[None], sin.cpu()[None], interleave)[0]
    tol = TOL[dtype] if dtype != torch.float32 else dict(rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(query[..., 20:].cpu(), want, **tol)


@pytest.mark.parametrize("dtype,cache_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                               (torch.float32, torch.bfloat16)], ids=str)
@pytest.mark.parametrize("interleave", [True, False])
def test_latent_entries_match_norm_rotate_and_write(dtype, cache_dtype, interleave, kernel_device):
    """Six rows to shuffled slots of a NaN cache (latent 40, not a power of two; rope 8): the
    written slots equal [RMSNorm(latent), rotate(k)], every other slot stays NaN."""
    rows, latent, rope = 6, 40, 8
    kv = padded((rows, latent + rope), dtype, kernel_device, seed=11)
    weight = (torch.rand(latent, generator=torch.Generator().manual_seed(12)) + 0.5).to(dtype=dtype, device=kernel_device)
    cos, sin = cos_sin(rows, rope // 2, dtype, kernel_device)
    cache = torch.full((4, 4, latent + rope), float("nan"), dtype=cache_dtype, device=kernel_device)
    slots = torch.randperm(16, generator=torch.Generator().manual_seed(13))[:rows]
    write_latent_entries(kv, weight, 1e-6, cos, sin, cache, slots.to(kernel_device), interleave)
    kv_cpu = kv.cpu()
    k = rotate(kv_cpu[None, :, None, latent:], cos.cpu()[None], sin.cpu()[None], interleave)[0, :, 0]
    want = torch.cat([rms_norm_reference(kv_cpu[:, :latent], weight.cpu(), 1e-6), k], -1).to(cache_dtype)
    flat = cache.view(-1, latent + rope).cpu()
    tol = TOL[torch.bfloat16] if torch.bfloat16 in (dtype, cache_dtype) else TOL[torch.float32]
    torch.testing.assert_close(flat[slots], want, **tol)
    untouched = torch.ones(16, dtype=torch.bool)
    untouched[slots] = False
    assert flat[untouched].isnan().all(), "wrote outside the mapped slots"


@pytest.mark.parametrize("change,match", [
    (lambda a: a.update(cos=a["cos"][:, :-1]), r"cos must be \[T=3, rope/2=4\]"),
    (lambda a: a.update(sin=a["sin"].half()), "sin must be torch.float32"),
    (lambda a: a.update(weight=a["weight"][:-1]), "kv's width 24 must be weight's size 15 plus an even"),
    (lambda a: a.update(slot_mapping=a["slot_mapping"].int()), "slot_mapping must be contiguous int64"),
    (lambda a: a.update(cache=a["cache"][..., :-1]), r"cache must be contiguous \[..., 24\]"),
    (lambda a: a.update(kv=a["kv"][None]), r"kv must be \[T, C \+ R\]"),
])
def test_write_latent_entries_rejects_bad_inputs(change, match, kernel_device):
    d = kernel_device
    args = dict(kv=torch.randn(3, 24, device=d), weight=torch.ones(16, device=d), eps=1e-6,
                cos=torch.ones(3, 4, device=d), sin=torch.zeros(3, 4, device=d), cache=torch.zeros(2, 4, 24, device=d),
                slot_mapping=torch.arange(3, device=d), interleave=True)
    change(args)
    with pytest.raises((ValueError, TypeError), match=match):
        write_latent_entries(**args)
