"""benchmarks/replay_drafter.py: replayed rounds put the target's token at its recorded rank with
the recorded probabilities (or nowhere, for the always-wrong drafter); benchmarks/auto_budget.py
end to end on the CPU with the tiny config, and its bars on given rows."""

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import auto_budget  # noqa: E402
from auto_budget_report import bars, speed_key  # noqa: E402
from replay_drafter import ReplayDrafter  # noqa: E402

from ddtree.models.drafter import DrafterCache  # noqa: E402
from ddtree.tree import topk_logprobs  # noqa: E402

VOCAB, DEPTH, K = 50, 3, 4


class ZeroDrafter(torch.nn.Module):
    """The wrapped drafter's interface: its logits are replaced anyway."""

    def __init__(self):
        super().__init__()
        self.cfg = SimpleNamespace(block_size=DEPTH + 1, vocab_size=VOCAB)
        self.fc = torch.nn.Linear(2, 2)

    def draft_logits(self, target, bonus, cache, key_limit=None):
        return torch.zeros(bonus.shape[0], DEPTH, VOCAB)


@pytest.fixture
def recorded(tmp_path):
    lp = torch.log(torch.tensor([[0.5, 0.2, 0.1, 0.05], [0.9, 0.05, 0.01, 0.01], [0.3, 0.3, 0.2, 0.1]]))
    path = tmp_path / "rounds.safetensors"
    save_file({"ranks": torch.tensor([[0, 2, -1], [1, 0, 3]], dtype=torch.int16),
               "logprobs": torch.stack([lp, lp.flip(0)]).half()}, str(path))
    return path


def test_replayed_rounds_rank_the_truth_as_recorded(recorded):
    replay = ReplayDrafter(ZeroDrafter(), max_batch=2, max_len=40, recorded=recorded)
    replay.set_sequence(0, list(range(10, 30)))
    replay.set_sequence(1, list(range(20, 25)))  # known up to position 24
    cache = DrafterCache([], [], torch.tensor([5, 22]))
    logits = replay.draft_logits(None, torch.zeros(2, dtype=torch.long), cache)
    assert logits.shape == (2, DEPTH, VOCAB) and torch.isfinite(logits).all()
    assert torch.allclose(torch.logsumexp(logits, -1), torch.zeros(2, DEPTH), atol=1e-4)  # a distribution
    lp, tok = topk_logprobs(logits, K)
    for slot, length in ((0, 5), (1, 22)):
        pick = int(((slot * 1_000_003 + length * ((0x9E3779B97F4A7C15 >> 2))) & ((1 << 62) - 1)) % 2)
        want_lp = replay.logprobs[pick]
        torch.testing.assert_close(lp[slot], want_lp, atol=1e-4, rtol=0)
        seq = replay.sequences[slot]
        for d in range(DEPTH):
            truth = int(seq[length + d + 1])
            rank = int(replay.recorded_ranks[pick, d]) if truth >= 0 else -1
            hits = (tok[slot, d] == truth).nonzero().flatten().tolist()
            assert hits == ([rank] if rank >= 0 else []), (slot, d)
    replay.wrong = True
    _, tok = topk_logprobs(replay.draft_logits(None, torch.zeros(2, dtype=torch.long), cache), K)
    for slot, length in ((0, 5), (1, 22)):
        truths = replay.sequences[slot, length + 1 : length + 1 + DEPTH]
        assert not (tok[slot] == truths[:, None]).any()


def test_bars_on_given_rows():
    def row(batch, config, speed):
        return {"batch": batch, "config": config, "decode_tokens_per_s": speed}
    rows = [row(1, "ar", 100.0) | {"pass_seconds": [1.0, 1.02, 1.01]}, row(1, "ddtree 4", 120.0), row(1, "auto", 114.0),
            row(8, "ar", 400.0), row(8, "chain", 300.0), row(8, "auto", 396.0), row(8, "auto, wrong drafter", 380.0)]
    got = bars(rows, replay=True)
    assert got["auto_over_best_min_replay"] == pytest.approx(0.95)
    assert got["auto_over_ar_min"] == pytest.approx(0.95)
    assert got["per_batch"]["1"]["best_fixed"] == "ddtree 4" and got["per_batch"]["1"]["ar_spread"] == pytest.approx(0.02)
    assert "auto_over_best_min_demo" in bars(rows, replay=False)
    # a continuous schedule compares throughput with the prefills: here auto leads at B = 1
    total = [r | {"tokens_per_s": {"ar": 90.0, "ddtree 4": 100.0}.get(r["config"], 110.0)} for r in rows]
    assert bars(total, replay=True, key=speed_key("continuous"))["per_batch"]["1"]["auto_over_best"] == pytest.approx(1.1)
    assert speed_key("groups") == "decode_tokens_per_s"


def test_the_benchmark_runs_on_the_tiny_pair(tmp_path, monkeypatch):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    monkeypatch.setattr(sys, "argv", ["auto_budget.py", "--pair", "tiny", "--device", "cpu", "--batches", "1", "2",
                                      "--budgets", "4", "--new", "12", "--prefix", "16", "--wrong", "--passes", "2",
                                      "--schedule", "continuous",
                                      "--out-dir", str(tmp_path)])
    try:
        auto_budget.main()
    finally:
        torch.set_num_threads(threads)
    payload = json.loads((tmp_path / "auto_budget-tiny-none-cpu.json").read_text())
    configs = [r["config"] for r in payload["rows"] if r["batch"] == 2]
    assert configs == ["ar", "chain", "ddtree 4", "auto", "auto, wrong drafter"]
    assert all(r["equal_to_ar"] == r["requests"] and r["decode_tokens_per_s"] > 0 for r in payload["rows"])
    assert all(len(r["pass_seconds"]) == 2 for r in payload["rows"])
    # Continuous batching reuses slots (8 prompts over 2): each admitted prompt's truth reached its
    # slot, so the replayed drafter is accepted; without it every round would commit 1 token.
    tree = next(r for r in payload["rows"] if r["batch"] == 2 and r["config"] == "ddtree 4")
    assert payload["schedule"] == "continuous" and tree["requests"] == 8 and tree["mean_acceptance_length"] > 2
    assert set(payload["bars"]) == {"auto_over_best_min_replay", "auto_over_ar_min", "per_batch"}
    png = tmp_path / "auto_budget-tiny-none-cpu.png"  # the test extra brings matplotlib: a plot, always
    assert png.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")


def test_each_auto_configuration_learns_apart():
    """Interleaved passes: what auto learned with the wrong drafter never reaches plain auto."""
    from ddtree.engine.sizing import TreeSizer

    engine, replay = SimpleNamespace(sizer=TreeSizer((1, 4), 3)), SimpleNamespace(wrong=False)
    outside = engine.sizer.state
    auto, wrong = auto_budget.AutoState(engine, replay, False), auto_budget.AutoState(engine, replay, True)
    with wrong:
        assert replay.wrong and engine.sizer.state is not outside
        engine.sizer.state.ledger.observe([[0, -1, -1, -1]], [1], 4)
        engine.sizer.correction.observe(1, 0, 2.0, 1.0)
    assert not replay.wrong and engine.sizer.state is outside
    with auto:
        assert not replay.wrong
        assert engine.sizer.state.ledger.frontier == 0 and engine.sizer.correction.ratios == {}
    with wrong:
        assert engine.sizer.state.ledger.frontier == 4
    assert outside.ledger.frontier == 0 and outside.correction.ratios == {}
    assert wrong.ratios == {(1, 0): (2.0, 1)} and auto.ratios == {}
