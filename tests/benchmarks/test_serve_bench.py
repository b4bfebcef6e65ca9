"""serve_bench's modes: ar, chain, ddtree with --budget, or ddtree:N / ddtree:auto per entry."""

import sys
from pathlib import Path

import pytest

pytest.importorskip("httpx")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from serve_bench import make_bodies, parse_modes  # noqa: E402


def test_modes_carry_their_budget_auto_included():
    assert parse_modes("ar,chain,ddtree,ddtree:16,ddtree:auto", "64") == [
        ("ar", None), ("chain", None), ("ddtree", 64), ("ddtree", 16), ("ddtree", "auto")]
    assert parse_modes("ddtree", "auto") == [("ddtree", "auto")]
    for bad, why in [("tree", "need ar, chain, ddtree"), ("ar:4", "need ar, chain, ddtree"),
                     ("ddtree:0", "a budget is auto or an int > 0"), ("ddtree:big", "a budget is auto")]:
        with pytest.raises(ValueError, match=f"entry '{bad}': {why}"):
            parse_modes(bad, "64")


def test_each_request_sends_its_mode_and_budget():
    class Args:
        max_tokens, temperature, ignore_eos, seed = 8, 0.0, True, 5

    auto = make_bodies(Args, ["a", "b"], "ddtree", "auto", 3, "m", offset=1)
    assert [b["ddtree"] for b in auto] == [{"mode": "ddtree", "budget": "auto"}] * 3
    assert [b["prompt"] for b in auto] == ["b", "a", "b"] and [b["seed"] for b in auto] == [6, 7, 8]
    assert make_bodies(Args, ["a"], "ar", None, 1, "m", offset=0)[0]["ddtree"] == {"mode": "ar"}
