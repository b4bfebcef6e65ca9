"""benchmarks/engine_round.py end to end on the CPU with the tiny config (2 of its 3 layers, so the
scaling to the published depth runs too): every stage of every (B, budget) cell timed with a
finite positive floor, the bars, and the forced-acceptance rows."""

import json
import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import engine_round  # noqa: E402

TREE_STAGES = {"draft", "topk", "build", "verify", "accept", "commit", "round"}
AR_STAGES = {"verify", "accept", "commit", "round"}


def positive(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


@pytest.fixture(scope="module")
def payload(tmp_path_factory):
    out = tmp_path_factory.mktemp("engine_round")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls: extra OpenMP threads only contend (3x slower on a loaded 2-core box)
    try:
        md = engine_round.main(["--config", "tiny", "--layers", "2", "--device", "cpu", "--prefix", "48", "--batches", "1", "8", "32",
                                "--budgets", "16", "64", "--repeats", "1", "--warmup", "0", "--e2e-batches", "1", "8",
                                "--lengths", "4", "--new-tokens", "9", "--out", str(out)])
    finally:
        torch.set_num_threads(threads)
    assert md.is_file() and "## Bars" in md.read_text()
    return json.loads(md.with_suffix(".json").read_text())


def test_every_cell_and_stage_has_a_time_and_a_floor(payload):
    cells = {(c["B"], c["budget"]): c for c in payload["cells"]}
    assert set(cells) == {(b, n) for b in (1, 8, 32) for n in (0, 16, 64)}
    for (batch, budget), cell in cells.items():
        stages = TREE_STAGES if budget else AR_STAGES
        assert set(cell["eager"]) == stages, (batch, budget)
        assert all(positive(cell["eager"][s]["median"]) for s in stages)
        assert all(positive(cell["floors"][s]["floor_us"]) for s in stages)
        assert positive(cell["floors"]["weight_read"]["floor_us"])
        assert len(cell["experts"]["union_per_moe_layer"]) == 1  # tiny: one MoE layer
        assert cell["graph"] is None  # no graphs on the CPU
        scaled = cell["scaled"]  # 3 layers: one more MoE layer
        assert scaled["layers"] == 3 and scaled["floor_round_us"] > cell["floors"]["round"]["floor_us"]
        assert scaled["measured_round_us"] > cell["eager"]["round"]["median"]


def test_bars_are_the_ratios_of_the_written_stage_times(payload):
    """Each bar recomputed here from the cells' stage medians and floors (eager on the CPU: no
    graph) equals the one written, so a bar built from the wrong cell or stage fails."""
    bars = payload["bars"]
    assert set(bars) == {"ar_step_b1_over_floor", "build_accept_commit_share_b8_budget64", "draft_share_b1_budget64",
                         "around_verify_ms_b1_budget16", "around_verify_ms_b32_budget16", "draft_over_floor_max",
                         "topk_over_floor_max", "commit_over_floor_max"}
    cells = {(c["B"], c["budget"]): c for c in payload["cells"]}
    ar, b8, b1 = cells[1, 0], cells[8, 64]["eager"], cells[1, 64]["eager"]
    around = lambda m: sum(m[s]["median"] for s in ("draft", "topk", "build", "accept", "commit")) / 1e3  # noqa: E731
    worst = lambda stage: max(c["eager"][stage]["median"] / c["floors"][stage]["floor_us"]  # noqa: E731
                              for c in cells.values() if c["budget"])  # ar's commit: no tree's
    want = {"ar_step_b1_over_floor": ar["eager"]["round"]["median"] / ar["floors"]["weight_read"]["floor_us"],
            "build_accept_commit_share_b8_budget64":
                (b8["build"]["median"] + b8["accept"]["median"] + b8["commit"]["median"]) / b8["round"]["median"],
            "draft_share_b1_budget64": b1["draft"]["median"] / b1["round"]["median"],
            "around_verify_ms_b1_budget16": around(cells[1, 16]["eager"]),
            "around_verify_ms_b32_budget16": around(cells[32, 16]["eager"]),
            "draft_over_floor_max": worst("draft"), "topk_over_floor_max": worst("topk"),
            "commit_over_floor_max": worst("commit")}
    assert bars == pytest.approx(want, rel=1e-12)
    assert all(positive(v) for v in bars.values())
    assert bars["build_accept_commit_share_b8_budget64"] < 1 and bars["draft_share_b1_budget64"] < 1


def test_forced_acceptance_reproduces_ar_at_the_forced_length(payload):
    rows = payload["e2e"]
    assert {(r["batch"], r["mode"], r["L"]) for r in rows} == (
        {(b, "ar", 1) for b in (1, 8)} | {(b, m, 4) for b in (1, 8) for m in ("chain", "ddtree")})
    for r in rows:
        assert r["equal_to_ar"] == r["batch"] and positive(r["tokens_per_s"])
        if r["mode"] == "ar":
            assert r["successor_match"] == 1.0
        else:  # 8 tokens after the prefill's first, in rounds of L = 4; the random rest of
            # a tree may hold the target's next token by chance (budget 64 of a 4096-token vocabulary)
            assert abs(r["mean_acceptance_length"] - r["L"]) <= 0.5, r


def test_png_beside_the_json(payload):  # the test extra brings matplotlib: a plot, always
    png = Path(payload["args"]["out"]).joinpath("engine_round-tiny-2l-none-cpu.png")
    assert png.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
