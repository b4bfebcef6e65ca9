"""The fused MoE kernels, compiled for sm_90 here (no GPU needed): the alignment's sort, histogram
and gather lower for the GPU, and the GEMMs run on tensor cores with pipelined loads and no spills."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Triton's CUDA toolchain ships for Linux")

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def reports() -> dict:
    # A fresh interpreter without TRITON_INTERPRET: under it Triton's library functions (tl.sort)
    # are interpreter objects that the compiler refuses.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = "import json; from tests.models.fused_moe_compile import all_reports; print(json.dumps(all_reports()))"
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True)
    if done.returncode:
        pytest.fail(done.stderr[-3000:])
    return json.loads(done.stdout.splitlines()[-1])


def test_no_kernel_spills(reports):
    for name, report in reports.items():
        assert report["spill_bytes"] == 0 and report["registers"] <= 255, (name, report)


def test_gemms_use_tensor_cores_and_pipelined_loads(reports):
    for name in ("gate_up", "down"):
        report = reports[name]
        assert report["mma"] > 0, (name, report)
        assert report["async_copies"] > 0, (name, report)  # loads of the next K step overlap the MMAs
        assert report["shared"] <= 232448, (name, report)  # the sm_90 opt-in limit per block (227 KB)
