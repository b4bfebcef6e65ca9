"""The fused router compiled for sm_90 here (no GPU needed): no spills at the served shapes, and
IEEE divides (div.rn), as torch's sigmoid and softmax, so that near-tied scores round alike."""

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
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the compiler, not the interpreter
    code = "import json; from tests.models.router_kernel_compile import all_reports; print(json.dumps(all_reports()))"
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True)
    if done.returncode:
        pytest.fail(done.stderr[-3000:])
    return json.loads(done.stdout.splitlines()[-1])


def test_router_compiles_without_spills_or_fast_divides(reports):
    assert set(reports) == {"deepseek_v3", "kimi_k2", "moonlight", "deepseek_v2_lite"}
    for name, report in reports.items():
        assert report["spill_bytes"] == 0 and report["registers"] <= 255, (name, report)
        assert report["approx_divides"] == 0, (name, report)
