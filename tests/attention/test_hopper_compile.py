"""The Gluon Hopper kernel, compiled for sm_90 here (no GPU needed): it fits one multiprocessor
and does each tile's tensor-core work once (the reason it exists beside the Triton kernel)."""

import sys

import pytest

from ..sm90_assembly import compiled_in_fresh_interpreter

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Triton's CUDA toolchain ships for Linux")


def _report(page_rows: int, epilogue: int) -> dict:
    return compiled_in_fresh_interpreter(
        "import json; from tests.attention.hopper_compile import compile_report; "
        f"r = compile_report({page_rows}, {epilogue}); r.pop('ttgir'); print(json.dumps(r))")


@pytest.mark.parametrize("page_rows,epilogue", [(64, 2), (16, 1), (64, 0)])
def test_kernel_fits_an_sm_and_does_no_mma_twice(page_rows, epilogue):
    report = _report(page_rows, epilogue)
    assert report["shared"] <= 232448, report["shared"]  # the sm_90 opt-in limit per block (227 KB)
    # A few spilled words (40-52 B since the row sums became per-column accumulators, which
    # measured 2-3% faster than the spill-free version); a larger spill means a regression.
    assert report["registers"] <= 255 and report["spill_bytes"] <= 64, (report["registers"], report["spill_bytes"])
    assert not report["serialized_wgmma"]  # ptxas's C7515: every wgmma waiting for the last
    assert report["pdl_waits"] == 1 and report["waits_first"]  # as launched on the H200, with PDL (ops/launch.py)
    # Per 64 x 64 tile and warpgroup: S over 576 dims in k-steps of 16 (36 x n32, the warpgroup's
    # own key columns) and P.V over 64 keys (4 x n256, its own value columns). Triton's own
    # lowering of the same loop gives 72 + 4: S computed by both warpgroups.
    assert report["hgmma"] == {"64x32x16": 36, "64x256x16": 4}, report["hgmma"]
