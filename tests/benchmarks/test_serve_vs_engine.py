"""benchmarks/serve_vs_engine.py end to end on the CPU, at its smallest: ar at concurrency 1 and 2, the
clients of concurrency 2 in two processes."""

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
    monkeypatch.setattr(sys, "argv", ["serve_vs_engine.py", "--device", "cpu", "--concurrency", "1", "2", "--modes", "ar",
                                      "--max-tokens", "4", "--requests", "2", "--client-processes", "2", "--repeats", "2",
                                      "--clients", "aiohttp", "httpx", "--burst", "--out-dir", str(tmp_path)])
    serve_vs_engine.main()
    payload = json.loads(next(tmp_path.glob("serve_vs_engine-*.json")).read_text())
    row, pair, *other = payload["rows"]  # aiohttp's cells, then httpx's over the same server
    assert [(r["mode"], r["concurrency"], r["client"], r["server_errors"]) for r in payload["rows"]] == [
        ("ar", 1, "aiohttp", 0), ("ar", 2, "aiohttp", 0), ("ar", 1, "httpx", 0), ("ar", 2, "httpx", 0)]
    assert all(r["server_tokens"] == 8 and r["server_decode_tokens_per_s"] > 0 for r in other)
    assert payload["bars"]["client"] == "aiohttp" and set(payload["client_versions"]) == {"aiohttp", "httpx"}
    assert row["engine_decode_tokens_per_s"] > 0 and row["server_decode_tokens_per_s"] > 0
    assert payload["repeats"] == 2 and len(row["server_decode_tokens_per_s_runs"]) == 2
    assert row["server_decode_tokens_per_s"] in row["server_decode_tokens_per_s_runs"]
    assert row["server_tokens"] == pair["server_tokens"] == 8  # 2 requests a cell, EOS ignored: max_tokens made
    assert payload["bars"]["server_over_engine_min"] == pytest.approx(min(r["server_over_engine"] for r in (row, pair)))
    assert payload["bars"]["ttft_gap_ms_c1"] == pytest.approx(row["server_ttft_p50_ms"] - row["engine_ttft_p50_ms"])
    for r in (row, pair):  # both sides' passes: the engine's reported pass is one of its runs
        assert r["engine_decode_tokens_per_s"] in r["engine_decode_tokens_per_s_runs"]
        assert len(r["engine_decode_tokens_per_s_runs"]) == 2 and r["engine_burst_decode_tokens_per_s"] > 0
        assert r["engine_steps"] >= 4 and r["engine_prefills"] >= 1 and 0 < r["engine_batch_mean"] <= r["concurrency"]
    for r in (row, pair):  # the engine core computed every token: it ran for part of the cell at least
        assert 0 < r["server_core_cpu"] <= 1.5 and 0 < r["server_client_cpu"] <= 1.5, r
        assert 0 <= r["server_http_cpu"] <= 1.5, r
