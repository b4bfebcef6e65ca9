"""benchmarks/tp_projection.py with and without a measured rank (tp_rank_forward.py's JSON), and
tp_rank_forward's LoneRank: a rank's share of the model with the collectives left out."""

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import tp_projection  # noqa: E402
from round_setup import TINY  # noqa: E402
from target_forward import setup  # noqa: E402
from tp_rank_forward import LoneRank  # noqa: E402

from ddtree.models import TargetConfig, random_target  # noqa: E402

BUDGETS = [0, 4]


def measured_file(tmp_path, prefix=1024, config="kimi-k2.6") -> Path:
    rows = [{"batch": b, "rows": n, "forward_us": 1000.0 * b + 10.0 * n} for b in (1, 8) for n in (1, 5)]
    env = {"gpu": "NVIDIA H200", "commit": "abc1234"}
    path = tmp_path / "rank.json"
    path.write_text(json.dumps({"config": config, "prefix": prefix, "ranks": 8, "rows": rows, "environment": env}))
    return path


def run(tmp_path, *extra) -> dict:
    md = tp_projection.main(["--batches", "1", "8", "--budgets", *map(str, BUDGETS), "--out", str(tmp_path), *extra])
    return json.loads(md.with_suffix(".json").read_text())


def test_a_measured_rank_replaces_the_read_estimate_and_keeps_the_collectives(tmp_path, monkeypatch):
    monkeypatch.setenv("DDTREE_COMMIT", "test")
    assumed = run(tmp_path / "a", "--ranks", "8")
    measured = run(tmp_path / "m", "--measured", str(measured_file(tmp_path)))
    assert measured["projection"] and measured["measured_run"]["gpu"] == "NVIDIA H200"
    assert len(assumed["rows"]) == len(measured["rows"]) == 4
    for a, m in zip(assumed["rows"], measured["rows"]):
        assert (a["batch"], a["rows"]) == (m["batch"], m["rows"])
        assert m["read_us"] == 1000.0 * m["batch"] + 10.0 * m["rows"] != a["read_us"]
        assert m["collectives_us"] == pytest.approx(a["collectives_us"]) and m["collectives"] == 2 * 61 + 2
        assert m["step_us"] == pytest.approx(m["read_us"] + m["collectives_us"])
    ar = {r["batch"]: r["step_us"] for r in measured["rows"] if r["rows"] == 1}
    assert all(r["over_ar"] == pytest.approx(r["step_us"] / ar[r["batch"]]) for r in measured["rows"])
    assert "measured on one NVIDIA H200" in (tmp_path / "m").joinpath(
        next(p.name for p in (tmp_path / "m").glob("*.md"))).read_text()


def test_a_measured_file_of_another_prefix_or_a_missing_shape_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("DDTREE_COMMIT", "test")
    with pytest.raises(SystemExit, match="prefix 512"):
        run(tmp_path, "--measured", str(measured_file(tmp_path, prefix=512)))
    with pytest.raises(SystemExit, match="B = 8, rows = 9"):
        tp_projection.main(["--batches", "8", "--budgets", "8", "--out", str(tmp_path),
                            "--measured", str(measured_file(tmp_path))])


def test_a_lone_rank_holds_its_share_and_returns_full_logits():
    cfg = TargetConfig.from_dict(dict(TINY))
    whole = random_target(cfg, dtype=torch.float32)
    lone = random_target(cfg, dtype=torch.float32, shard=LoneRank(1, 2))
    experts = lambda m: sum(p.numel() for layer in m.layers[1:] for p in layer.mlp.parameters(recurse=False))  # noqa: E731
    assert experts(lone) * 2 == experts(whole) > 0
    assert lone.embed_tokens.weight.shape[0] * 2 == cfg.vocab_size
    t = torch.ones(3)
    assert LoneRank(1, 2).all_reduce(t) is t and LoneRank(0, 4).all_gather(t).shape == (12,)
    with pytest.raises(ValueError, match="rank 2 is not in a world of 2"):
        LoneRank(2, 2)
    ids, meta, caches = setup(lone, batch=2, rows=3, prefix=5, device="cpu")
    with torch.no_grad():
        logits, _ = lone.forward_paged(ids, meta, caches)
    assert logits.shape == (2, 3, cfg.vocab_size) and torch.isfinite(logits).all()
