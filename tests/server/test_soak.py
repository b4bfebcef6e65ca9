"""The soak test's short form (benchmarks/serve_soak.py has the long one): a few hundred requests
at concurrency 32, mixed modes, budgets, temperatures and endpoints, with clients that leave
mid-stream and clients that send bad input. No 5xx, bad input refused, every completion equal to
the same request served alone, every page free after, /metrics adding up, memory flat."""

import asyncio
import os
import sys
from pathlib import Path

import httpx
import pytest

from .conftest import start_server

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import serve_soak  # noqa: E402


def test_short_soak(pairs):
    with start_server(pairs, max_batch=8, max_queue=512) as live:
        warm = serve_soak.make_cases(64, seed=1)
        asyncio.run(serve_soak.run_cases(live.url, warm, 32))  # one-time allocations out of the figure
        cases = serve_soak.make_cases(320, seed=2)
        refs = serve_soak.references(live.url, cases)
        live.wait_idle()
        before = serve_soak.counters(httpx.get(f"{live.url}/metrics").text)
        rss_before = serve_soak.rss_mib(os.getpid())
        results = asyncio.run(serve_soak.run_cases(live.url, cases, 32))
        health = live.wait_idle()
        report = serve_soak.check(cases, results, refs)
        sums = serve_soak.counters_add_up(cases, results, before, serve_soak.counters(httpx.get(f"{live.url}/metrics").text))
        growth = serve_soak.rss_mib(os.getpid()) - rss_before
    kinds = {k: sum(c["kind"] == k for c in cases) for k in ("ok", "chat", "leave", "bad")}
    assert min(kinds.values()) > 10, kinds  # every kind of client took part
    assert report["server_errors"] == 0 and report["bad_input_not_refused"] == 0, report
    assert report["mismatches"] == 0, report["mismatch_examples"]
    assert report["statuses"] == {"200": kinds["ok"] + kinds["chat"], "400": kinds["bad"], "499": kinds["leave"]}
    assert (health["running"], health["queued"], health["pages_free"]) == (0, 0, health["pages_total"]), health
    assert sums["ok"], sums
    assert growth < 64, f"resident memory grew {growth:.0f} MiB over {len(cases)} requests"


@pytest.mark.parametrize("share", [0.0])
def test_cases_mix(share):
    cases = serve_soak.make_cases(200, seed=3, leave_share=share, bad_share=share)
    assert {c["kind"] for c in cases} == {"ok", "chat"}
    assert serve_soak.make_cases(200, seed=3, leave_share=share, bad_share=share) == cases  # reproducible
