"""tree_verify_mla against the float64 reference: paged caches, ragged batches, real trees."""

import math

import pytest
import torch

from ddtree.attention import api, tree_verify_mla, tree_verify_mla_reference

from ..conftest import gpu_or_scaled
from .cases import Case, make_inputs

SCALE = 192**-0.5 * 1.2**2  # (qk_nope + qk_rope)^-0.5 * mscale^2, as for Kimi K2


def _run_and_compare(case: Case, device: str, backend: str, num_splits=None, tol=1e-2):
    q, kv, bt, pl, nn, vis = make_inputs(case, device)
    out = torch.full(q.shape[:3] + (512,), float("nan"), dtype=q.dtype, device=device)
    lse = torch.full(q.shape[:3], float("nan"), dtype=torch.float32, device=device)
    tree_verify_mla(q, kv, bt, pl, nn, vis, SCALE, num_splits=num_splits, out=(out, lse), backend=backend)
    ref_out, ref_lse = tree_verify_mla_reference(q.cpu(), kv.cpu(), bt.cpu(), pl.cpu(), nn.cpu(), vis.cpu(), SCALE)
    out, lse = out.cpu().double(), lse.cpu().double()
    assert not torch.isnan(out).any(), "NaN in out (unwritten row or a stray read)"
    assert not torch.isnan(lse).any(), "NaN in lse"
    valid = torch.arange(case.rows)[None, :] < torch.tensor(case.tree_rows)[:, None]  # [B, N]
    assert (out[~valid] == 0).all() and torch.isinf(lse[~valid]).all(), "padding rows must be 0 / -inf"
    err = (out[valid] - ref_out[valid]).norm() / ref_out[valid].norm().clamp_min(1e-30)
    assert err < tol, f"relative error {err:.2e}"
    cos = torch.nn.functional.cosine_similarity(out[valid].flatten(), ref_out[valid].flatten(), dim=0)
    assert cos > 0.9999
    worst = (lse[valid] - ref_lse[valid]).abs().max()
    assert worst < 2e-2, f"lse off by {worst:.2e}"


PAGE_EDGE_PREFIXES = [0, 1, 15, 16, 17, 200]  # 0, 1, page-1, page, page+1, long (page 16)


@pytest.mark.parametrize("page_size", [16, 64])
def test_prefix_edges_ragged_tree_batch(page_size, kernel_device, attention_backend):
    prefixes = [p * page_size // 16 for p in PAGE_EDGE_PREFIXES]
    case = Case(heads=16, prefixes=prefixes, tree_rows=[9, 1, 5, 9, 3, 7], rows=9, page_size=page_size, seed=page_size)
    _run_and_compare(case, kernel_device, attention_backend)


@pytest.mark.parametrize("heads,rows", [(16, 1), (64, 5), (64, 65), (128, 3)])
def test_heads_and_tree_sizes(heads, rows, kernel_device, attention_backend):
    case = Case(heads=heads, prefixes=[37, 70], tree_rows=[rows, max(1, rows - 2)], rows=rows, seed=heads + rows)
    _run_and_compare(case, kernel_device, attention_backend)


def test_chain_and_fp16(kernel_device, attention_backend):
    case = Case(heads=16, prefixes=[5, 64], tree_rows=[12, 12], rows=12, chain=True, dtype=torch.float16)
    _run_and_compare(case, kernel_device, attention_backend, tol=5e-3)


@pytest.mark.parametrize("num_splits", [1, 2, 5])
def test_split_kv_matches(num_splits, kernel_device, attention_backend):
    # 5 splits of a 300-key range leave some splits with few or no keys for short requests.
    case = Case(heads=16, prefixes=[280, 3], tree_rows=[6, 6], rows=6, seed=num_splits)
    _run_and_compare(case, kernel_device, attention_backend, num_splits=num_splits)


# Each case at full size on a GPU; on the CPU the same shape scaled down to seconds under the
# interpreter.
@pytest.mark.parametrize("heads,prefixes,rows,page", [
    # long and one-token prefixes over 64-key pages; row tiles across nodes, the last one partial
    gpu_or_scaled((64, [4096, 1, 777], 65, 64), (2, [300, 1, 77], 65, 64), "long-ragged"),
    # more heads than a row tile: each node's heads split over tiles; 16-key pages
    gpu_or_scaled((128, [300, 2000], 65, 16), (128, [100, 300], 2, 16), "128-heads"),
    # more than two visibility words (257 rows: five; interpreted, 193: four), the last holding one row's bit
    gpu_or_scaled((64, [33, 65], 257, 64), (1, [3, 65], 193, 64), "many-words"),
    # one long request: the automatic choice splits its keys (MAX_SPLITS on a GPU, 4 interpreted)
    gpu_or_scaled((16, [32768], 16, 64), (4, [1000], 16, 64), "long-prefix"),
    # many requests: on the GPU 600 one-tile work items, more than a program per SM each
    gpu_or_scaled((16, [0, 3, 64, 1, 200] * 60, 5, 16), (4, [0, 3, 64, 1, 200] * 2, 5, 16), "many-requests"),
])
def test_large_shapes(heads, prefixes, rows, page, kernel_device, attention_backend):
    tree_rows = [rows - i % rows for i in range(len(prefixes))]
    case = Case(heads=heads, prefixes=prefixes, tree_rows=tree_rows, rows=rows, page_size=page)
    _run_and_compare(case, kernel_device, attention_backend)


# (heads, rows, num_splits, the epilogue the launcher picks): each output path of the Hopper kernel
HOPPER_EPILOGUES = [(64, 16, 1, 2), (16, 9, 1, 1), (64, 16, 2, 0), (16, 9, 3, 0)]


def test_the_hopper_epilogue_cases_cover_every_path():
    """The launcher's choice (api.hopper_epilogue, no GPU needed): staged + TMA store only for whole
    64-row tiles per request and one split (16 heads x 9 rows = 144 rows is not: TMA would write
    into the next request), staged + 16-byte stores otherwise, direct float32 partials with splits.
    So test_every_hopper_epilogue's cases reach all three."""
    for heads, rows, num_splits, epilogue in HOPPER_EPILOGUES:
        assert api.hopper_epilogue(rows * heads, num_splits) == epilogue, (heads, rows, num_splits)
    assert {case[3] for case in HOPPER_EPILOGUES} == {0, 1, 2}
    assert [api.hopper_epilogue(n, 1) for n in (64, 128, 144, 65, 1)] == [2, 2, 1, 1, 1]


@pytest.mark.cuda
@pytest.mark.parametrize("heads,rows,num_splits", [case[:3] for case in HOPPER_EPILOGUES])
def test_every_hopper_epilogue(heads, rows, num_splits):
    """Each output path of the Hopper kernel, as the launcher picks it: staged + TMA store (whole
    64-row tiles per request, one split), staged + 16-byte stores (a tile that spills into the next
    request, one split), direct float32 stores of the partials (several splits)."""
    probe = torch.empty(1, 1, 1, 576, dtype=torch.bfloat16, device="cuda")
    why_not = api.hopper_unsupported(probe, torch.empty(1, 64, 576, dtype=torch.bfloat16, device="cuda"))
    if why_not:
        pytest.skip(f"the hopper backend cannot run here: {why_not}")
    prefixes = [0, 1, 63, 64, 65, 700, 3, 130] * 20  # 160 requests: programs of the persistent grid walk several items
    tree_rows = [rows - i % rows for i in range(len(prefixes))]
    case = Case(heads=heads, prefixes=prefixes, tree_rows=tree_rows, rows=rows, page_size=64, seed=num_splits)
    _run_and_compare(case, "cuda", "hopper", num_splits=num_splits)


def test_scale_is_the_callers():
    case = Case(heads=16, prefixes=[20], tree_rows=[3], rows=3)
    q, kv, bt, pl, nn, vis = make_inputs(case, "cpu")
    _, lse_a = tree_verify_mla_reference(q, kv, bt, pl, nn, vis, SCALE)
    _, lse_b = tree_verify_mla_reference(q, kv, bt, pl, nn, vis, 576**-0.5)
    assert not torch.allclose(lse_a, lse_b)
    assert math.isfinite(float(lse_a[0, 0, 0]))
