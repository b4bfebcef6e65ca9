"""skinny_matmul against a float64 matmul: nn.Linear and per-head (MLA) layouts, strided outputs,
masked tails, float32 outputs; outputs start as NaN so an unwritten element shows."""

from __future__ import annotations

import pytest
import torch

from ddtree.ops.gemm import MAX_ROWS, block_n_for, linear, skinny_matmul

TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.double().cpu(), want.double().cpu()
    assert not torch.isnan(got).any(), f"NaN at {torch.isnan(got).nonzero()[:5].tolist()}"
    return float((got - want).norm() / want.norm())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("rows,depth,cols,block_n,block_k", [
    (1, 64, 48, None, 32),      # one row, N not a multiple of the block
    (5, 300, 40, 16, 64),       # K tail masked, three N blocks, the last masked
    (MAX_ROWS, 96, 16, 32, 256),  # every row of the tile, one K step larger than K
])
def test_linear_layout_matches_float64(rows, depth, cols, block_n, block_k, dtype, kernel_device):
    gen = torch.Generator().manual_seed(rows + depth)
    x = torch.randn(rows, depth, generator=gen).to(dtype)
    weight = (torch.randn(cols, depth, generator=gen) / depth**0.5).to(dtype)
    out = torch.full((1, rows, cols), float("nan"), dtype=dtype, device=kernel_device)
    skinny_matmul(x.to(kernel_device)[None], weight.to(kernel_device).t()[None], out, block_n=block_n, block_k=block_k)
    assert rel_err(out[0], x.double() @ weight.double().t()) < TOL[dtype]


def test_per_head_layout_into_a_strided_view(kernel_device):
    """MLA's absorbed query: q_nope [rows, H, nope] times W_UK [H, nope, C], written into the
    latent slice of a wider [rows, H, C + rope] buffer, batched over heads; the rope columns stay."""
    gen = torch.Generator().manual_seed(3)
    rows, heads, nope, latent, rope = 3, 4, 24, 40, 8
    q = torch.randn(rows, heads, nope + rope, generator=gen).bfloat16().to(kernel_device)
    w = (torch.randn(heads, nope, latent, generator=gen) / nope**0.5).bfloat16().to(kernel_device)
    query = torch.full((rows, heads, latent + rope), float("nan"), dtype=torch.bfloat16, device=kernel_device)
    skinny_matmul(q[..., :nope].transpose(0, 1), w, query[..., :latent].transpose(0, 1))
    want = torch.einsum("rhk,hkc->rhc", q[..., :nope].double().cpu(), w.double().cpu())
    assert rel_err(query[..., :latent], want) < TOL[torch.bfloat16]
    assert torch.isnan(query[..., latent:]).all(), "columns past the output view were written"


def test_float32_output_of_16_bit_inputs(kernel_device):
    """The router's logits: bf16 inputs, float32 output, products exact in float32."""
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(2, 128, generator=gen).bfloat16()
    weight = torch.randn(24, 128, generator=gen).bfloat16()
    got = linear(x.to(kernel_device), weight.to(kernel_device), out_dtype=torch.float32)
    assert got.dtype == torch.float32
    assert rel_err(got, x.double() @ weight.double().t()) < 1e-6


def test_block_n_fills_the_gpu():
    """At the H200's 132 multiprocessors: narrow blocks for a decode step's projections, wide ones
    where even those leave four programs per multiprocessor."""
    assert block_n_for(1, 3648, 132) == 16  # Moonlight's q / kv_a: 228 programs
    assert block_n_for(1, 64, 132) == 16  # the router: 4 programs, as thin as it goes
    assert block_n_for(1, 22528, 132) == 32  # layer 0's dense gate / up: 704 programs
    assert block_n_for(64, 512, 132) == 32  # Kimi K2's absorbed query over 64 heads: 1024 programs
    assert block_n_for(64, 7168, 132) == 64  # 64 rows of width 7168: 7168 programs


def test_rejects_bad_inputs(kernel_device):
    x = torch.zeros(1, MAX_ROWS + 1, 8, device=kernel_device)
    with pytest.raises(ValueError, match=f"at most {MAX_ROWS} rows"):
        skinny_matmul(x, torch.zeros(1, 8, 4, device=kernel_device))
    with pytest.raises(ValueError, match=r"x must be \[B, M, K\] and w \[B, K, N\]"):
        skinny_matmul(x[:, :2], torch.zeros(1, 7, 4, device=kernel_device))
    with pytest.raises(TypeError, match="w the same"):
        skinny_matmul(x[:, :2], torch.zeros(1, 8, 4, dtype=torch.float16, device=kernel_device))
    with pytest.raises(ValueError, match="block_n must be a power of two >= 16"):
        skinny_matmul(x[:, :2], torch.zeros(1, 8, 4, device=kernel_device), block_n=24)
    with pytest.raises(ValueError, match="out must be torch.float32"):
        skinny_matmul(x[:, :2], torch.zeros(1, 8, 4, device=kernel_device), torch.zeros(1, 2, 5, device=kernel_device))
