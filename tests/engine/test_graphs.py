"""Rounds replayed from CUDA graphs (engine/graphs.py) commit exactly what eager rounds commit."""

import pytest
import torch

pytest.importorskip("transformers")

from ddtree import Engine  # noqa: E402
from ddtree.engine.scheduling import PlanLimits, key_bound  # noqa: E402

from .pairs import make_pair, prompts  # noqa: E402


def test_the_drafter_key_bound_of_eager_and_graphed_rounds():
    """Eager rounds read keys rounded up to 64; graphed ones a power of two of at least 1024, so
    that a growing context needs a new graph only when its length doubles; never past the cache."""
    graphed = PlanLimits(4, 15, 100, False, drafter_capacity=4096, graphed=True)
    assert [key_bound(n, graphed) for n in (1, 64, 1000, 1024, 1025, 2049)] == [1024, 1024, 1024, 1024, 2048, 4096]
    assert key_bound(3000, PlanLimits(4, 15, 100, False, 3100, True)) == 3100  # never past the drafter cache
    assert key_bound(100, PlanLimits(4, 15, 100, False, 600, True)) == 600  # a small cache: its capacity
    eager = PlanLimits(4, 15, 100, False, drafter_capacity=4096)
    assert [key_bound(n, eager) for n in (1, 64, 65, 4090)] == [64, 64, 128, 4096]


def test_a_default_cpu_engine_runs_eagerly(tmp_path):
    from ddtree.engine.prefill_graphs import capture_prefill_graphs

    target_dir, drafter_dir, _ = make_pair(tmp_path)
    engine = Engine.from_pretrained(target_dir, drafter_dir, device="cpu")
    assert engine.graphs is None and engine.worker.prefill_graphs is None
    assert capture_prefill_graphs(engine) == []  # serve's start-up on the CPU: nothing to capture


def test_cuda_graphs_refuse_a_cpu_engine(tmp_path):
    target_dir, drafter_dir, _ = make_pair(tmp_path)
    with pytest.raises(ValueError, match="cuda_graphs needs a bf16 model on a CUDA device"):
        Engine.from_pretrained(target_dir, drafter_dir, device="cpu", cuda_graphs=True)


def test_graphs_wanted_follows_the_switch_the_device_and_the_dtype(monkeypatch):
    """The engine's choice (graphs_wanted) without a GPU: True demands graphs and refuses all but a
    bf16 model on CUDA; None takes them for bf16 on CUDA sm_90 / sm_100 only; False never."""
    from ddtree.engine.graphs import graphs_wanted

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    for device, dtype in [(cuda, torch.float32), (cuda, torch.float16), (cpu, torch.bfloat16), (cpu, torch.float32)]:
        with pytest.raises(ValueError, match="cuda_graphs needs a bf16 model on a CUDA device"):
            graphs_wanted(True, device, dtype)
        assert not graphs_wanted(None, device, dtype) and not graphs_wanted(False, device, dtype)
    assert graphs_wanted(True, cuda, torch.bfloat16) and not graphs_wanted(False, cuda, torch.bfloat16)
    asked = []
    for major, want in [(8, False), (9, True), (10, True), (12, False)]:
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: asked.append(device) or (major, 0))
        assert graphs_wanted(None, cuda, torch.bfloat16) is want, major
    assert asked == [cuda] * 4


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_cuda_graphs_refuse_other_dtypes_than_bf16(tmp_path, dtype):
    """float32 and fp16 route through torch._grouped_mm's host-copying fallback, which a graph cannot hold."""
    target_dir, drafter_dir, _ = make_pair(tmp_path)
    with pytest.raises(ValueError, match="cuda_graphs needs a bf16 model"):
        Engine.from_pretrained(target_dir, drafter_dir, device="cuda", dtype=dtype, cuda_graphs=True)


def test_plan_description_names_its_shape():
    from ddtree.engine.graphs import describe
    from ddtree.engine.round import RoundPlan

    plan = RoundPlan(bucket=8, budget=64, k=64, any_sampled=True, any_filtered=False, key_limit=1024, features=True,
                     experts=True)
    assert describe(plan) == "batch 8, tree budget 64, drafter keys <= 1024, sampled"
    assert describe(RoundPlan(bucket=1, budget=0, k=0, any_sampled=False, any_filtered=False, key_limit=None,
                              features=False, experts=False)) == "batch 1, ar"
    auto = RoundPlan(bucket=4, budget=8, k=64, any_sampled=False, any_filtered=False, key_limit=256, features=True,
                     experts=False, paths=True, flush=True)
    assert describe(auto) == ("batch 4, tree budget 8, drafter keys <= 256, accepted paths reported, "
                              "drafter context appended")


@pytest.mark.cuda
def test_graphed_rounds_equal_eager_rounds(tmp_path, caplog):
    caplog.set_level("INFO", logger="ddtree.engine")
    dtype = torch.bfloat16
    target_dir, drafter_dir, _ = make_pair(tmp_path)
    batch = prompts(6, 96, seed=8)
    kwargs = dict(device="cuda", dtype=dtype, page_size=16, max_batch=8, stop_token_ids=())
    eager = Engine.from_pretrained(target_dir, drafter_dir, cuda_graphs=False, **kwargs)
    graphed = Engine.from_pretrained(target_dir, drafter_dir, cuda_graphs=True, **kwargs)
    for mode, budget, temperature in [("ar", 1, 0.0), ("chain", 1, 0.0), ("ddtree", 16, 0.0), ("ddtree", 16, 1.0)]:
        seeds = list(range(len(batch)))
        want = eager.generate(batch, max_new_tokens=40, mode=mode, budget=budget, temperature=temperature, seed=seeds)
        got = graphed.generate(batch, max_new_tokens=40, mode=mode, budget=budget, temperature=temperature, seed=seeds)
        assert [o.token_ids for o in got] == [o.token_ids for o in want], (mode, budget, temperature)
        assert [o.stats.acceptance_lengths for o in got] == [o.stats.acceptance_lengths for o in want]
    assert graphed.graphs.captures >= 4 and graphed.graphs.replays > graphed.graphs.captures
    assert sum("captured CUDA graph" in r.message for r in caplog.records) == graphed.graphs.captures
    assert graphed.blocks.num_free == graphed.blocks.num_pages


@pytest.mark.cuda
def test_requests_joining_and_leaving_a_graphed_batch(tmp_path):
    """Continuous batching over graphs: slots fill and empty between replays of the same bucket."""
    target_dir, drafter_dir, _ = make_pair(tmp_path)
    kwargs = dict(device="cuda", dtype=torch.bfloat16, page_size=16, max_batch=4, stop_token_ids=())
    eager = Engine.from_pretrained(target_dir, drafter_dir, cuda_graphs=False, **kwargs)
    graphed = Engine.from_pretrained(target_dir, drafter_dir, cuda_graphs=True, **kwargs)
    batch = prompts(10, 96, seed=3)
    lengths = [8 + 5 * (i % 4) for i in range(len(batch))]  # requests finish at different rounds
    want = eager.generate(batch, max_new_tokens=lengths, mode="ddtree", budget=8)
    got = graphed.generate(batch, max_new_tokens=lengths, mode="ddtree", budget=8)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert graphed.graphs.replays > 0


@pytest.mark.cuda
def test_auto_rounds_graphed_equal_eager_through_plain_steps_and_trees(tmp_path):
    """budget "auto" with the size forced through plain steps (rows set aside, flushed after 16)
    and trees of several sizes: graphed rounds commit what eager rounds commit, and leave the same
    drafter context."""
    from ddtree import SamplingParams
    from ddtree.engine.costs import RoundCosts

    target_dir, drafter_dir, _ = make_pair(tmp_path)
    engines = []
    for graphs in (False, True):
        engine = Engine.from_pretrained(target_dir, drafter_dir, device="cuda", dtype=torch.bfloat16, page_size=16,
                                        max_batch=4, stop_token_ids=(), cuda_graphs=graphs)
        engine.sizer.costs = RoundCosts(engine.signature, {})  # sizes are forced: nothing to measure
        for p in prompts(3, 96, seed=12):
            engine.add_request(p, SamplingParams(max_new_tokens=200))
        engines.append(engine)
    pattern = ([0] * 5 + [4] + [0] * 18 + [2, 16, 16]) * 2
    outs = [[], []]
    for size in pattern:
        for engine, out in zip(engines, outs):
            engine.sizer.forced = size
            out.append([(o.request_id, o.new_token_ids) for o in engine.step()])
    assert outs[0] == outs[1] and engines[1].graphs.replays > 0
    eager, graphed = (e.state for e in engines)
    assert torch.equal(eager.drafter.lengths, graphed.drafter.lengths)
    assert torch.equal(eager.pending_rows, graphed.pending_rows) and torch.equal(eager.prefix_lens, graphed.prefix_lens)
    for slot in range(3):
        n = int(eager.drafter.lengths[slot])
        for a, b in zip(eager.drafter.keys + eager.drafter.values, graphed.drafter.keys + graphed.drafter.values):
            assert torch.equal(a[slot, :n], b[slot, :n])


@pytest.mark.cuda
def test_a_given_cost_table_still_captures_auto_rounds_before_the_first_request(tmp_path):
    """Costs from a given (or kept) table measure nothing, yet every bucket's budget auto rounds
    are captured before the first one runs: the generate after runs no eager round (each would
    be an eager round and a capture on the request path)."""
    from ddtree.engine.costs import RoundCosts

    target_dir, drafter_dir, _ = make_pair(tmp_path)
    load = dict(device="cuda", dtype=torch.bfloat16, page_size=16, max_batch=4, stop_token_ids=())
    probe = Engine.from_pretrained(target_dir, drafter_dir, **load)
    sizes = probe.sizer.sizes
    table = RoundCosts(probe.signature, {b: {s: 1e-3 * (1 + b / 8) * (1 + s / 16) for s in sizes} for b in (1, 2, 4)})
    engine = Engine.from_pretrained(target_dir, drafter_dir, round_costs=table, **load)
    engine.measure_round_costs()
    assert engine.graphs.warm_buckets == {1, 2, 4} and engine.graphs.captures > 0
    eager = engine.graphs.eager_rounds
    outs = engine.generate(prompts(4, 48, seed=5), 60, budget="auto")
    assert all(len(o.token_ids) == 60 for o in outs)
    assert engine.graphs.eager_rounds == eager, dict(engine.graphs.eager_plans)


@pytest.mark.cuda
def test_prompts_admitted_alone_replay_prefill_graphs(tmp_path):
    """Continuous batching admits a finished request's successor alone: its prefill is padded to a
    row bucket and replayed from a graph (eager at a bucket's first prefill, captured at its
    second), and commits what the engine without graphs commits (which prefills the same padded
    shapes eagerly); greedy and sampled."""
    target_dir, drafter_dir, _ = make_pair(tmp_path)
    kwargs = dict(device="cuda", dtype=torch.bfloat16, page_size=16, max_batch=2, stop_token_ids=())
    eager = Engine.from_pretrained(target_dir, drafter_dir, cuda_graphs=False, **kwargs)
    graphed = Engine.from_pretrained(target_dir, drafter_dir, cuda_graphs=True, **kwargs)
    batch = prompts(9, 96, seed=4, lengths=(3, 40))  # row buckets 16, 32 and 64
    lengths = [6 + 4 * (i % 3) for i in range(len(batch))]
    for temperature in (0.0, 1.0):
        seeds = list(range(len(batch)))
        want = eager.generate(batch, max_new_tokens=lengths, mode="ddtree", budget=8, temperature=temperature, seed=seeds)
        got = graphed.generate(batch, max_new_tokens=lengths, mode="ddtree", budget=8, temperature=temperature, seed=seeds)
        assert [o.token_ids for o in got] == [o.token_ids for o in want], temperature
    used, unused = graphed.worker.prefill_graphs, eager.worker.prefill_graphs
    assert used.captures >= 2 and used.replays >= 4 and used.eager_prefills == len(used._seen)
    assert unused.captures == 0 and unused.replays == 0 and unused.eager_prefills >= len(batch)  # a prefill a group
    assert graphed.blocks.num_free == graphed.blocks.num_pages


@pytest.mark.cuda
def test_prefill_graphs_captured_before_the_first_request(tmp_path):
    """capture_prefill_graphs (serve's start-up) captures every (group, row bucket) prefill for
    each sampling flag set, so later admissions only replay: greedy, sampled and cut, the first
    admission of two prompts and the single ones after it."""
    from ddtree.engine.prefill_graphs import capture_prefill_graphs

    target_dir, drafter_dir, _ = make_pair(tmp_path)
    engine = Engine.from_pretrained(target_dir, drafter_dir, device="cuda", dtype=torch.bfloat16, page_size=16,
                                    max_batch=2, max_model_len=100, stop_token_ids=())
    graphs = engine.worker.prefill_graphs
    assert capture_prefill_graphs(engine) == [16, 32, 64, 128]  # 99 rows fit bucket 128
    captured, eager = graphs.captures, graphs.eager_prefills
    assert captured == 4 * 2 * 3  # buckets x groups of 2 and 1 (max_batch 2) x sampling flags
    for temperature, top_k in ((0.0, 0), (0.7, 0), (0.7, 5)):
        outs = engine.generate(prompts(5, 96, seed=6, lengths=(3, 90)), 8, mode="ddtree", budget=8,
                               temperature=temperature, top_k=top_k, seed=list(range(5)))
        assert all(len(o.token_ids) == 8 for o in outs)
    assert graphs.captures == captured and graphs.eager_prefills == eager and graphs.replays >= 15
