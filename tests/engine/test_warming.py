"""Round graphs of the modes a server serves, captured at start-up (engine/warming.py): afterwards
no request of those modes runs an eager round (a compile and a capture on the request path)."""

import argparse
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("transformers")

from ddtree import Engine  # noqa: E402
from ddtree.arguments import warm_modes  # noqa: E402
from ddtree.cli import main  # noqa: E402
from ddtree.engine.warming import capture_mode_graphs, default_warm_modes  # noqa: E402

from .pairs import make_pair, prompts  # noqa: E402


def test_warm_modes_parse_each_mode_once_and_name_a_bad_entry():
    assert warm_modes("ar,chain,ddtree:16,ddtree:auto,ar") == [("ar", None), ("chain", None), ("ddtree", 16),
                                                                ("ddtree", "auto")]
    assert warm_modes("none") == []
    for bad in ("ddtree", "ddtree:0", "ar:4", "tree", "chain:auto", "", "ar,none"):
        with pytest.raises(argparse.ArgumentTypeError, match="none of ar, chain, ddtree:auto, ddtree:N"):
            warm_modes(bad)


def test_default_warm_modes_follow_the_budget_and_the_drafter():
    assert default_warm_modes("auto", True) == [("ar", None), ("chain", None), ("ddtree", "auto")]
    assert default_warm_modes(8, True) == [("ar", None), ("chain", None), ("ddtree", 8)]
    assert default_warm_modes("auto", False) == [("ar", None)]


def test_serve_names_a_bad_warm_mode(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["serve", "--warm-modes", "ar,ddtree:0"])
    assert exit_.value.code == 2 and "argument --warm-modes: 'ddtree:0' is none of" in capsys.readouterr().err


@pytest.mark.parametrize("argv,message", [
    (["--max-budget", "64", "--warm-modes", "ar,ddtree:128"], "--warm-modes ddtree:128 is above --max-budget 64"),
    (["--target", "TARGET", "--mode", "ar", "--warm-modes", "ar,chain"], "--warm-modes chain: needs --drafter DIR"),
])
def test_serve_refuses_warm_modes_it_cannot_run_in_one_line(argv, message, tmp_path, capsys):
    (tmp_path / "config.json").write_text("{}")
    assert main(["serve", *(str(tmp_path) if a == "TARGET" else a for a in argv)]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and message in err, err


def test_a_cpu_engine_warms_nothing_but_checks_the_modes(tmp_path):
    target_dir, drafter_dir, _ = make_pair(tmp_path)
    engine = Engine.from_pretrained(target_dir, drafter_dir, device="cpu", max_budget=16)
    assert capture_mode_graphs(engine, [("ar", None), ("ddtree", 16)]) == []
    assert capture_mode_graphs(engine, []) == []
    with pytest.raises(ValueError, match="max_budget=16"):
        capture_mode_graphs(engine, [("ddtree", 32)])
    alone = Engine.from_pretrained(target_dir, None, device="cpu")
    with pytest.raises(ValueError, match="needs a drafter"):
        capture_mode_graphs(alone, [("chain", None)])


def test_stand_ins_run_every_bucket_and_leave_nothing_behind(tmp_path):
    """The warm-up's stand-ins on this CPU engine (its graph counts stubbed, so that it runs as a
    graphed engine's would, eagerly): every (mode, bucket, sampling) shape runs full batches of
    stand-ins, and afterwards no request, page or lesson of the sizer's is left."""
    import pickle

    from ddtree.engine.costs import RoundCosts

    target_dir, drafter_dir, _ = make_pair(tmp_path)
    load = dict(device="cpu", max_batch=2, max_budget=2, stop_token_ids=(), kept_costs="off")
    probe = Engine.from_pretrained(target_dir, drafter_dir, **load)
    table = RoundCosts(probe.signature, {b: {s: 1e-3 * (1 + b / 8) * (1 + s / 16) for s in probe.sizer.sizes}
                                         for b in (1, 2)})
    engine = Engine.from_pretrained(target_dir, drafter_dir, round_costs=table, **load)
    engine.graphs = SimpleNamespace(eager_rounds=0, captures=0, warm_buckets=set())
    batches, launch = [], engine.worker.round

    def recorded(table, plan, timer):
        batches.append((plan.bucket, plan.budget, plan.any_sampled, plan.any_filtered))
        return launch(table, plan, timer)

    engine.worker.round = recorded
    sizer_before = pickle.dumps(engine.sizer.state)
    assert capture_mode_graphs(engine, [("ar", None), ("ddtree", 2), ("ddtree", "auto")]) == [1, 2]
    flags = [(False, False), (True, False), (True, True)]
    fixed = {(b, budget, *f) for b in (1, 2) for budget in (0, 2) for f in flags}
    auto = {(b, size, *f) for b in (1, 2) for size in engine.sizer.sizes for f in flags[1:]}
    assert set(batches) == fixed | auto
    assert not engine.has_unfinished() and engine.blocks.num_free == engine.blocks.num_pages
    assert pickle.dumps(engine.sizer.state) == sizer_before and engine.sizer.forced is None


@pytest.mark.cuda
def test_warmed_modes_run_no_eager_round_at_any_bucket_or_sampling(tmp_path):
    """After the round costs (auto's greedy graphs) and capture_mode_graphs, requests of every warmed
    mode at 1 to 4 requests, greedy, sampled and cut, replay graphs only; the stand-ins leave no page
    or request behind."""
    target_dir, drafter_dir, _ = make_pair(tmp_path)
    engine = Engine.from_pretrained(target_dir, drafter_dir, device="cuda", dtype=torch.bfloat16, page_size=16,
                                    max_batch=4, stop_token_ids=(), kept_costs="off")
    engine.measure_round_costs(repeats=1, passes=1)
    modes = [("ar", None), ("chain", None), ("ddtree", 8), ("ddtree", "auto")]
    assert capture_mode_graphs(engine, modes) == [1, 2, 4]
    assert not engine.has_unfinished() and engine.blocks.num_free == engine.blocks.num_pages
    eager, captured = engine.graphs.eager_rounds, engine.graphs.captures
    for count in (4, 3, 1):
        for temperature, top_k in ((0.0, 0), (1.0, 0), (0.7, 5)):
            for mode, budget in modes:
                outs = engine.generate(prompts(count, 96, seed=count), [24 + 5 * i for i in range(count)], mode=mode,
                                       budget=1 if budget is None else budget, temperature=temperature, top_k=top_k,
                                       seed=list(range(count)))
                assert all(len(o.token_ids) == 24 + 5 * i for i, o in enumerate(outs))
                assert engine.graphs.eager_rounds == eager, (count, temperature, mode, budget,
                                                             dict(engine.graphs.eager_plans))
    assert engine.graphs.captures == captured
