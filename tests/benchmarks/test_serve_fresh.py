"""benchmarks/serve_fresh.py end to end on the CPU, at its smallest: ar at concurrency 1, both passes."""

import json
import shutil
import sys
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import serve_fresh  # noqa: E402


@pytest.mark.skipif(shutil.which("curl") is None, reason="the server's readiness is polled with curl")
def test_the_benchmark_writes_both_passes_and_the_bars(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["serve_fresh.py", "--device", "cpu", "--concurrency", "1", "2", "--modes", "ar",
                                      "--max-tokens", "4", "--requests", "2", "--serve-args", "--warm-modes ar",
                                      "--out-dir", str(tmp_path)])
    serve_fresh.main()
    payload = json.loads(next(tmp_path.glob("serve_fresh-*.json")).read_text())
    assert [(r["mode"], r["concurrency"]) for r in payload["rows"]] == [("ar", 1), ("ar", 2)]
    for row in payload["rows"]:
        for side in ("fresh", "warm"):
            cell = row[side]
            assert cell["errors"] == 0 and cell["output_tokens"] == 8  # 2 requests of 4 tokens, EOS ignored
            assert cell["ttft_max_ms"] >= cell["ttft_p99_ms"] >= cell["ttft_p50_ms"] > 0
            assert cell["ttft_max_ms"] >= cell["ttft_first_sent_ms"] > 0
            assert cell["eager_rounds"] == cell["round_graphs"] == 0  # the CPU: no graphs
        assert row["fresh_over_warm_ttft_p99"] == pytest.approx(row["fresh"]["ttft_p99_ms"] / row["warm"]["ttft_p99_ms"])
    bars = payload["bars"]
    assert bars["fresh_over_warm_ttft_p99_max"] == pytest.approx(max(r["fresh_over_warm_ttft_p99"] for r in payload["rows"]))
    assert bars["eager_rounds_first_pass"] == 0 and bars["errors"] == 0
    assert payload["start_up_s"] > 0 and payload["graph_counts_at_ready"]["ddtree_round_graphs"] == 0
