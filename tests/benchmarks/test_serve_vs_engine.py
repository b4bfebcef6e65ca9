"""benchmarks/serve_vs_engine.py end to end on the CPU, at its smallest: ar at concurrency 1."""

import json
import shutil
import sys
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import serve_vs_engine  # noqa: E402


@pytest.mark.skipif(shutil.which("curl") is None, reason="the server's readiness is polled with curl")
def test_the_benchmark_writes_both_sides_and_the_bars(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["serve_vs_engine.py", "--device", "cpu", "--concurrency", "1", "--modes", "ar",
                                      "--max-tokens", "4", "--requests", "1", "--out-dir", str(tmp_path)])
    serve_vs_engine.main()
    payload = json.loads(next(tmp_path.glob("serve_vs_engine-*.json")).read_text())
    (row,) = payload["rows"]
    assert (row["mode"], row["concurrency"], row["server_errors"]) == ("ar", 1, 0)
    assert row["engine_decode_tokens_per_s"] > 0 and row["server_decode_tokens_per_s"] > 0
    assert row["server_tokens"] == 4  # EOS ignored: max_tokens made
    assert payload["bars"]["server_over_engine_min"] == pytest.approx(row["server_over_engine"])
    assert payload["bars"]["ttft_gap_ms_c1"] == pytest.approx(row["server_ttft_p50_ms"] - payload["engine_prefill_ms_c1"])
