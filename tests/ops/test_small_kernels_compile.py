"""The decode step's small kernels compiled for sm_90 here (no GPU needed), as the H200 launches
them with programmatic dependent launch (ops/launch.py): each waits for its producer before its first
global memory access, and none spills."""

import sys

import pytest

from ..sm90_assembly import compiled_in_fresh_interpreter

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Triton's CUDA toolchain ships for Linux")


def test_each_waits_for_its_producer_before_touching_memory():
    reports = compiled_in_fresh_interpreter(
        "import json; from tests.ops.small_kernels_compile import all_reports; print(json.dumps(all_reports()))")
    assert set(reports) == {"rms_norm_delta", "rotary", "latent_entry", "merge_splits", "drafter_qkv", "topk_chunks",
                            "topk_merge"}
    for name, report in reports.items():
        assert report["pdl_waits"] == 1 and report["waits_first"], (name, report)
        assert report["spill_bytes"] == 0, (name, report)
