"""The decode step's few-row GEMM kernels compiled for sm_90 here (no GPU needed): no spills and
pipelined (cp.async) weight loads at their default tiles. A spilling tile cost the removed
norm-prologue GEMM its speed on the H200 (docs/notes/engine_speed.md)."""

import sys

import pytest

from ..sm90_assembly import compiled_in_fresh_interpreter

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Triton's CUDA toolchain ships for Linux")


@pytest.fixture(scope="module")
def reports() -> dict:
    return compiled_in_fresh_interpreter(
        "import json; from tests.ops.decode_gemm_compile import all_reports; print(json.dumps(all_reports()))")


def test_no_spills_tensor_cores_and_pipelined_loads(reports):
    assert set(reports) == {"linear_n16", "linear_n32", "linear_n64", "per_head_n32", "absorbed_query"}
    for name, report in reports.items():
        assert report["spill_bytes"] == 0 and report["registers"] <= 255, (name, report)
        assert report["mma"] > 0, (name, report)
        assert report["async_copies"] > 0, (name, report)
        assert report["shared"] <= 232448, (name, report)
        assert report["pdl_waits"] >= 1 and report["waits_first"], (name, report)  # PDL (ops/launch.py): waits first
