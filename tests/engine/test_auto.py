"""budget="auto" in the engine: the tokens are ar's (greedy, and seed for seed when sampling),
alone and in batches that mix modes; the size follows cost and acceptance; the cost table is
measured when missing and leaves no trace, and a table for another pair is refused."""

import itertools
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("transformers")

from ddtree import Engine  # noqa: E402
from ddtree.engine.costs import RoundCosts, StepCorrection  # noqa: E402
from oracle import OracleDrafter  # noqa: E402 (benchmarks/oracle.py)
from ddtree.models import load_drafter, load_target  # noqa: E402

from .pairs import make_pair, prompts  # noqa: E402

NEW = 24
SIZES = (0, 1, 2, 4, 8, 16, 32, 64)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    target_dir, drafter_dir, _ = make_pair(tmp_path_factory.mktemp("pair"), vocab=12, block_size=5)
    target = load_target(target_dir, dtype=torch.float32)
    return target, drafter_dir


def table(engine: Engine, tree_cost: float) -> RoundCosts:
    """A cost table for `engine`: a plain step costs 1, a tree `tree_cost` + a little per node."""
    row = {s: 1.0 if s == 0 else tree_cost + s / 1000 for s in SIZES}
    return RoundCosts(engine.signature, {b: dict(row) for b in (1, 2, 4, 8)})


def engine_with(models, *, tree_cost=None, drafter=None, **kwargs) -> Engine:
    target, drafter_dir = models
    engine = Engine(target, drafter or load_drafter(drafter_dir, target), page_size=8, max_batch=4, **kwargs)
    if tree_cost is not None:
        engine.sizer.costs = table(engine, tree_cost)
        # the table is in units of a plain step, not in seconds: steps must not correct it
        engine.sizer.correction = StepCorrection(limits=(1.0, 1.0))
    return engine


SAMPLED = dict(temperature=[1.0, 0.7, 1.2, 0.9], top_p=[1.0, 0.9, 1.0, 0.8], top_k=[0, 0, 6, 4], seed=[11, 12, 13, 2**50])


@pytest.mark.parametrize("tree_cost", [1.0, 3.0, 100.0])
def test_auto_equals_ar_greedy_and_sampled(models, tree_cost):
    engine = engine_with(models, tree_cost=tree_cost)
    batch = prompts(4, 12, seed=1)
    for settings in ({}, SAMPLED):
        ar = [o.token_ids for o in engine.generate(batch, max_new_tokens=NEW, mode="ar", **settings)]
        outs = engine.generate(batch, max_new_tokens=NEW, **settings)  # mode ddtree, budget "auto"
        assert [o.token_ids for o in outs] == ar
        for o in outs:
            assert len(o.stats.tree_sizes) == o.stats.rounds == len(o.stats.acceptance_lengths)
            assert set(o.stats.tree_sizes) <= set(SIZES)
    alone = engine.generate(batch[:1], max_new_tokens=NEW, **{k: v[:1] for k, v in SAMPLED.items()})
    assert alone[0].token_ids == engine.generate(batch[:1], max_new_tokens=NEW, mode="ar",
                                                 **{k: v[:1] for k, v in SAMPLED.items()})[0].token_ids


def test_auto_in_a_batch_of_every_mode(models):
    engine = engine_with(models, tree_cost=2.0)
    batch = prompts(6, 12, seed=3)
    want = [o.token_ids for o in engine.generate(batch, max_new_tokens=NEW, mode="ar")]
    modes = ["ddtree", "ar", "chain", "ddtree", "ddtree", "ar"]
    budgets = ["auto", 1, 1, 3, "auto", 1]
    outs = engine.generate(batch, max_new_tokens=NEW, mode=modes, budget=budgets)  # 6 prompts, 4 slots
    assert [o.token_ids for o in outs] == want
    assert all(s == 0 for s in outs[1].stats.tree_sizes) and all(s <= 3 for s in outs[3].stats.tree_sizes)
    assert all(s == 4 for s in outs[2].stats.tree_sizes)  # chain: D nodes


def _oracle_engine(models, depth, tree_cost):
    """The drafter proposes ar's greedy continuation for `depth` positions: acceptance depth + 1."""
    target, drafter_dir = models
    batch = prompts(2, 12, seed=5)
    ar = engine_with(models).generate(batch, max_new_tokens=60, mode="ar")
    oracle = OracleDrafter(load_drafter(drafter_dir, target), max_batch=4, max_len=128, depth=depth)
    for slot, (p, o) in enumerate(zip(batch, ar)):
        oracle.set_sequence(slot, p + o.token_ids)
    return engine_with(models, drafter=oracle, tree_cost=tree_cost), batch, [o.token_ids for o in ar]


@pytest.mark.parametrize("depth,tree_cost,trees_win", [(4, 2.0, True), (0, 2.0, False)])
def test_the_size_follows_cost_and_acceptance(models, depth, tree_cost, trees_win):
    """A drafter right for 4 positions: trees; right for none (acceptance 1): plain steps but for
    the first rounds (the largest tree, to learn) and probes. Both give ar's tokens."""
    engine, batch, want = _oracle_engine(models, depth, tree_cost)
    outs = engine.generate(batch, max_new_tokens=60)
    assert [o.token_ids for o in outs] == want
    sizes = [s for o in outs for s in o.stats.tree_sizes[4:]]  # after the first reads
    tree_share = sum(s > 0 for s in sizes) / len(sizes)
    if trees_win:  # 5 tokens a round for 2x the cost of one
        assert tree_share == 1.0 and min(sum(o.stats.acceptance_lengths) / o.stats.rounds for o in outs) > 3
    else:  # the oracle proposes nothing right (depth 0): only probes are trees
        assert tree_share < 0.3


def test_costs_are_measured_when_missing_and_leave_no_trace(models):
    engine = engine_with(models)
    assert engine.sizer.costs is None
    batch = prompts(3, 12, seed=7)
    outs = engine.generate(batch, max_new_tokens=8)
    costs = engine.sizer.costs
    assert costs.buckets() == [1, 2, 4] and all(costs.has(b, SIZES) for b in (1, 2, 4))
    assert all(t > 0 for row in costs.seconds.values() for t in row.values())
    assert costs.signature == engine.signature and costs.details["repeats"] == 6 and costs.details["passes"] == 2
    assert [len(o.token_ids) for o in outs] == [8, 8, 8]
    assert not engine.has_unfinished()
    assert engine.blocks.num_free == engine.blocks.num_pages and engine.blocks.num_promised == 0  # the stand-ins' pages are back
    want = engine.generate(batch, max_new_tokens=8, mode="ar")
    assert [o.token_ids for o in outs] == [o.token_ids for o in want]


def test_a_table_from_a_file_and_one_for_another_pair(models, tmp_path):
    engine = engine_with(models, tree_cost=2.0)
    path = tmp_path / "costs.json"
    engine.sizer.costs.save(path)
    target, drafter_dir = models
    loaded = Engine(target, load_drafter(drafter_dir, target), page_size=8, max_batch=4, round_costs=path)
    assert loaded.sizer.costs.seconds == engine.sizer.costs.seconds
    other = RoundCosts({**engine.signature, "device": "NVIDIA H200"}, {1: {0: 1.0}})
    other.save(path)
    with pytest.raises(ValueError, match="was measured for device = 'NVIDIA H200', but this engine has 'cpu'"):
        Engine(target, load_drafter(drafter_dir, target), page_size=8, round_costs=path)
    with pytest.raises(ValueError, match="no tree size in"):
        Engine(target, load_drafter(drafter_dir, target), page_size=8, max_budget=4, tree_sizes=(8, 16))


def test_plain_steps_keep_the_drafter_context_of_every_token(models):
    """Rows plain steps set aside reach the drafter's context before the next draft: whatever mix
    of plain steps and trees committed them, the context equals a tree-only run's, position for
    position (so no draft sees a stale or shifted context)."""
    prompt = prompts(1, 12, seed=9)[0]
    mixed, trees = engine_with(models, tree_cost=2.0, overlap=False), engine_with(models, overlap=False)
    from ddtree import SamplingParams

    params = SamplingParams(max_new_tokens=40)
    mixed.add_request(prompt, params)
    trees.add_request(prompt, params, budget=4)
    pattern = [0, 0, 0, 2, 0, 4] + [0] * 20 + [1, 0, 0, 8]  # 20 plain steps in a row: a flush on the way
    for size in pattern:
        mixed.sizer.forced = size
        mixed.step()
        state = mixed.state
        assert int(state.drafter.lengths[0] + state.pending_rows[0]) == int(state.prefix_lens[0])
        if size > 0:
            assert int(state.pending_rows[0]) == 0
    while int(trees.state.prefix_lens[0]) < int(mixed.state.prefix_lens[0]):
        trees.step()
    n = int(mixed.state.drafter.lengths[0])
    assert n == int(mixed.state.prefix_lens[0]) and n >= len(prompt) + len(pattern)
    for got, want in zip(mixed.state.drafter.keys + mixed.state.drafter.values,
                         trees.state.drafter.keys + trees.state.drafter.values):
        torch.testing.assert_close(got[0, :n], want[0, :n], rtol=1e-4, atol=1e-5)


def test_plain_steps_far_from_a_tree_leave_their_rows_out_at_true_positions(models):
    """Plain steps that do not set their rows aside (far from the next tree) leave them out of
    the drafter's context; every row it holds is the tree-only run's row of the same position,
    and the next draft comes after the last committed token (DrafterCache.skipped)."""
    from ddtree import SamplingParams

    prompt = prompts(1, 12, seed=9)[0]
    mixed, trees = engine_with(models, tree_cost=2.0, overlap=False), engine_with(models, overlap=False)
    params = SamplingParams(max_new_tokens=40)
    mixed.add_request(prompt, params)
    trees.add_request(prompt, params, budget=4)
    mixed.step()  # prefill (its first round too)
    pattern = [(0, False)] * 5 + [(0, True)] * 3 + [(2, True)] + [(0, False)] * 4 + [(8, True), (0, True), (4, True)]
    held = list(range(int(mixed.state.prefix_lens[0])))
    for size, keep in pattern:
        mixed.sizer.forced, mixed.sizer.forced_set_aside = size, keep
        before = int(mixed.state.prefix_lens[0])
        mixed.step()
        after = int(mixed.state.prefix_lens[0])
        if size > 0 or keep:
            held += range(before, after)
        state = mixed.state
        skipped = after - len(held)
        assert int(state.drafter.lengths[0] + state.pending_rows[0]) + skipped == after
    assert len(held) < int(mixed.state.prefix_lens[0])  # rows were left out
    while int(trees.state.prefix_lens[0]) < int(mixed.state.prefix_lens[0]):
        trees.step()
    n = int(mixed.state.drafter.lengths[0])
    assert n == len(held) and int(mixed.state.pending_rows[0]) == 0
    for got, want in zip(mixed.state.drafter.keys + mixed.state.drafter.values,
                         trees.state.drafter.keys + trees.state.drafter.values):
        torch.testing.assert_close(got[0, :n], want[0, held], rtol=1e-4, atol=1e-5)


def test_a_fixed_budget_above_the_largest_size_beside_auto(models):
    """A budget-128 request in the batch makes every round verify 128 nodes: the sizer's ledger
    reads the auto request's accepted paths within its own 64 (the drafter right for 4 positions:
    5 tokens a round)."""
    engine, batch, want = _oracle_engine(models, 4, tree_cost=1.5)
    engine.max_budget = 128
    outs = engine.generate(batch, max_new_tokens=60, budget=[128, "auto"])
    assert [o.token_ids for o in outs] == want
    ledger = engine.sizer.state.ledger
    assert ledger.frontier == 64 and ledger.tokens(64) == pytest.approx(5.0, abs=0.3)
    assert ledger.tokens(3) == pytest.approx(4.0, abs=0.3)  # the path's first three nodes
    assert outs[1].stats.tree_sizes[2:] == [64] * (outs[1].stats.rounds - 2)  # the fixed request's 128 shape


def test_round_costs_measure_what_fits_and_never_block_fixed_budgets(models):
    target, drafter_dir = models
    # each engine measures for itself here: none reads what another kept
    short = Engine(target, load_drafter(drafter_dir, target), page_size=8, max_batch=4, max_model_len=60,
                   kept_costs="off")
    batch = prompts(2, 12, seed=1, lengths=(3, 6))
    want = [o.token_ids for o in short.generate(batch, max_new_tokens=8, mode="ar")]
    assert [o.token_ids for o in short.generate(batch, max_new_tokens=8)] == want  # stand-ins shrunk to fit
    few_pages = Engine(target, load_drafter(drafter_dir, target), page_size=8, max_batch=4, max_model_len=256,
                       num_pages=40, kept_costs="off")
    batch = prompts(4, 12, seed=2, lengths=(3, 6))
    want = [o.token_ids for o in few_pages.generate(batch, max_new_tokens=8, mode="ar")]
    assert [o.token_ids for o in few_pages.generate(batch, max_new_tokens=8)] == want
    assert few_pages.sizer.costs.buckets() == [1] and few_pages.sizer.skipped == {2, 4}
    assert few_pages.blocks.num_free == 40 and not few_pages.has_unfinished()
    assert few_pages.sizer.unmeasured([1, 2, 4]) == []  # no second try at what cannot fit
    tiny = Engine(target, load_drafter(drafter_dir, target), page_size=8, max_batch=2, num_pages=9,
                  kept_costs="off")  # 72 slots
    assert [len(o.token_ids) for o in tiny.generate([[1, 2]], max_new_tokens=2)] == [2]  # no table: smallest tree
    assert "cannot hold one stand-in" in tiny.sizer.failure


def test_the_drafter_context_has_room_for_set_aside_rows_at_the_end(tmp_path):
    """A short context, a small prefill chunk and a small block: plain steps and trees in turn
    up to max_model_len never write past the drafter's cache."""
    target_dir, drafter_dir, _ = make_pair(tmp_path, vocab=96, block_size=5)
    target = load_target(target_dir, dtype=torch.float32)
    engine = Engine(target, load_drafter(drafter_dir, target), page_size=8, max_batch=2, max_model_len=40,
                    prefill_chunk=2, overlap=False)
    engine.sizer.costs = RoundCosts(engine.signature, {})
    from ddtree import SamplingParams

    prompt = prompts(1, 96, seed=1, lengths=(3, 4))[0]
    rid = engine.add_request(prompt, SamplingParams(max_new_tokens=36))
    steps, capacity = 0, engine.state.drafter.keys[0].shape[1]
    while engine.has_unfinished():
        engine.sizer.forced = steps % 2
        engine.step()
        steps += 1
        state = engine.state
        if engine.has_unfinished():  # every committed row is in the drafter's context or set aside for it
            assert int(state.drafter.lengths[0] + state.pending_rows[0]) == int(state.prefix_lens[0]) <= capacity
    out = engine.take_result(rid)
    assert steps > 20 and {0, 1} <= set(out.stats.tree_sizes)  # both kinds of round ran
    assert len(out.token_ids) == 36 or out.finish_reason == "stop"
    # greedy, float32: the alternating rounds commit ar's tokens, token for token
    assert out.token_ids == engine.generate([prompt], max_new_tokens=36, mode="ar")[0].token_ids


def test_generate_leaves_nothing_behind_when_a_step_fails(models, monkeypatch):
    engine = engine_with(models, tree_cost=2.0)
    real, calls = engine.step, []

    def failing():
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("device lost")
        return real()

    monkeypatch.setattr(engine, "step", failing)
    with pytest.raises(RuntimeError, match="device lost"):
        engine.generate(prompts(3, 12, seed=4), max_new_tokens=20)
    assert not engine.has_unfinished() and engine.blocks.num_free == engine.blocks.num_pages
    monkeypatch.setattr(engine, "step", real)
    assert len(engine.generate(prompts(1, 12, seed=5), max_new_tokens=4)[0].token_ids) == 4


@pytest.mark.parametrize("tree_cost", [2.0, 100.0])
def test_the_engine_teaches_the_sizer_what_its_steps_cost(models, tree_cost):
    """An auto step's wall time reaches the sizer's correction when the step before it had the
    same size (an interval after another size holds that step's tail; a plain step's, after two:
    the host's work on a tree's tokens outlasts one), except the one whose interval holds a
    prefill; fixed budgets and the cost measurement's stand-ins teach nothing. Trees at 2 plain
    steps run trees; at 100, plain runs between probes."""
    engine = engine_with(models, tree_cost=tree_cost)
    engine.sizer.correction = StepCorrection()
    batch = prompts(1, 12, seed=3)
    engine.generate(batch, max_new_tokens=NEW, mode="ddtree", budget=4)
    assert engine.sizer.correction.ratios == {}
    engine.drain()  # the round launched after the request's last: read now, not between auto steps
    out = engine.generate(batch, max_new_tokens=NEW)[0]
    exact = {key: count for key, (_, count) in engine.sizer.correction.ratios.items() if key[1] >= 0}
    sizes = out.stats.tree_sizes
    # the first read follows the prefill; a plain step counts after two plain steps, a tree after one of its size
    steady = [sizes[k] for k in range(1, len(sizes)) if sizes[k - 1] == sizes[k] and (sizes[k] or k >= 2 and sizes[k - 2] == 0)]
    assert sum(exact.values()) == len(steady) and 0 < len(steady) < len(sizes) - 1
    assert (0 in sizes) == (tree_cost > 10)
    assert exact == {(1, s): steady.count(s) for s in set(steady)}
    assert {size for _, size in exact} <= set(out.stats.tree_sizes) and {b for b, _ in exact} == {1}
    # the table's costs are seconds, these steps milliseconds: every ratio clamps at its floor
    assert all(ratio == 0.5 for ratio, _ in engine.sizer.correction.ratios.values())


def test_an_eager_round_or_a_capture_teaches_the_sizer_nothing(models):
    """A launch that ran its round eagerly or captured its graph (engine.graphs counts them) holds
    host time no steady step has: neither the interval read just after it (the round before's,
    read while it was launched) nor its own round's reaches the correction."""
    engine = engine_with(models, tree_cost=2.0)
    engine.sizer.correction = StepCorrection()
    engine.graphs = SimpleNamespace(eager_rounds=0, captures=0, warm_buckets={1, 2, 4})  # this CPU engine has none
    irregular, launches, real = {6, 7, 12}, itertools.count(), engine.worker.round

    def counted(*args, **kwargs):
        if next(launches) in irregular:
            engine.graphs.captures += 1
        return real(*args, **kwargs)

    engine.worker.round = counted
    sizes = engine.generate(prompts(1, 12, seed=3), max_new_tokens=NEW)[0].stats.tree_sizes
    spoiled = irregular | {k - 1 for k in irregular}
    def steady(k):  # round k read after round k - 1 of its size (a plain step: after two)
        return sizes[k - 1] == sizes[k] and (sizes[k] > 0 or k >= 2 and sizes[k - 2] == 0 and k - 1 not in spoiled)

    kept = [sizes[k] for k in range(1, len(sizes)) if steady(k) and k not in spoiled]
    steady = [sizes[k] for k in range(1, len(sizes)) if sizes[k - 1] == sizes[k]]
    assert len(kept) < len(steady)  # spoiled intervals were steady ones: the rule has something to leave out
    exact = {key: count for key, (_, count) in engine.sizer.correction.ratios.items() if key[1] >= 0}
    assert exact == {(1, s): kept.count(s) for s in set(kept)}
