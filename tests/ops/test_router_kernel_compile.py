"""The fused router compiled for sm_90 here (no GPU needed): no spills at the served shapes, and
IEEE divides (div.rn), as torch's sigmoid and softmax, so that near-tied scores round alike."""

import sys

import pytest

from ..sm90_assembly import compiled_in_fresh_interpreter

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Triton's CUDA toolchain ships for Linux")


@pytest.fixture(scope="module")
def reports() -> dict:
    return compiled_in_fresh_interpreter(
        "import json; from tests.ops.router_kernel_compile import all_reports; print(json.dumps(all_reports()))")


def test_router_compiles_without_spills_or_fast_divides(reports):
    assert set(reports) == {"deepseek_v3", "kimi_k2", "moonlight", "deepseek_v2_lite"}
    for name, report in reports.items():
        assert report["spill_bytes"] == 0 and report["registers"] <= 255, (name, report)
        assert report["approx_divides"] == 0, (name, report)
        assert report["pdl_waits"] >= 1 and report["waits_first"], (name, report)  # PDL (ops/launch.py): waits first
