"""benchmarks/serve_vs_generate.py end to end on the CPU, at its smallest: one round of ar."""

import json
import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import serve_vs_generate  # noqa: E402


@pytest.mark.skipif(shutil.which("curl") is None, reason="the benchmark's client is curl")
def test_the_benchmark_writes_both_speeds(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["serve_vs_generate.py", "--device", "cpu", "--modes", "ar", "--rounds", "1",
                                      "--new", "4", "--max-batch", "1", "--out-dir", str(tmp_path)])
    serve_vs_generate.main()
    payload = json.loads(next(tmp_path.glob("serve_vs_generate-*.json")).read_text())
    (row,) = payload["rows"]
    assert row["mode"] == "ar" and len(row["generate"]) == 1 and len(row["serve"]) == 2
    assert row["generate_median"] > 0 and row["serve_median"] > 0
    assert row["serve_over_generate"] == pytest.approx(row["serve_median"] / row["generate_median"])
