"""The request interface: add_request / step / abort, stops cut inside an accepted path, text
and streaming, statistics, and errors that name what was wrong."""

import random

import pytest
import torch

pytest.importorskip("transformers")

from ddtree import Engine, SamplingParams  # noqa: E402
from ddtree.engine import KVCacheFull  # noqa: E402
from oracle import OracleDrafter  # noqa: E402 (benchmarks/oracle.py)
from ddtree.models import load_drafter, load_target  # noqa: E402

from .pairs import EOS, make_pair  # noqa: E402


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    target_dir, drafter_dir, _ = make_pair(tmp_path_factory.mktemp("pair"), tokenizer=True, block_size=8, eos_token_id=EOS)
    return target_dir, drafter_dir


@pytest.fixture(scope="module")
def engine(pair):
    return Engine.from_pretrained(*pair, device="cpu", page_size=8, max_batch=4, max_model_len=256)


def _oracle_engine(pair, text_prompt, continuation_len=40):
    """An engine whose drafter proposes ar's continuation of `text_prompt`: long accepted paths."""
    target_dir, drafter_dir = pair
    plain = Engine.from_pretrained(target_dir, drafter_dir, device="cpu", page_size=8, stop_token_ids=())
    prompt_ids = plain.tokenize(text_prompt)
    ar = plain.generate([prompt_ids], max_new_tokens=continuation_len, mode="ar")[0].token_ids
    target = plain.target
    oracle = OracleDrafter(load_drafter(drafter_dir, target), max_batch=4, max_len=128)
    oracle.set_sequence(0, prompt_ids + ar)
    return Engine(target, oracle, plain.tokenizer, page_size=8, max_batch=4, stop_token_ids=()), ar


def test_text_prompts_stream_and_decode(engine):
    rid = engine.add_request("def fib(n):", SamplingParams(max_new_tokens=12), mode="ddtree", budget=8)
    streamed, tokens = "", []
    while engine.has_unfinished():
        for out in engine.step():
            assert out.request_id == rid
            tokens += out.new_token_ids
            streamed += out.new_text
    result = engine.take_result(rid)
    assert result.token_ids == tokens and streamed == result.text
    assert result.text == engine.tokenizer.decode(tokens, skip_special_tokens=True)
    assert result.finish_reason in ("stop", "length") and len(tokens) <= 12


def test_max_new_tokens_and_stop_tokens_cut_inside_an_accepted_path(pair):
    engine, ar = _oracle_engine(pair, "x = [")
    out = engine.generate(["x = ["], max_new_tokens=5, mode="chain")[0]
    assert out.token_ids == ar[:5] and out.finish_reason == "length"
    assert out.stats.acceptance_lengths == [4]  # the round accepted 8 and kept the 4 that fit
    stop_at = 9
    out = engine.generate(["x = ["], max_new_tokens=40, mode="ddtree", budget=16, stop=[ar[stop_at]])[0]
    first = ar.index(ar[stop_at])
    assert out.token_ids == ar[: first + 1] and out.finish_reason == "stop"  # the stop token is included


def test_stop_strings_end_the_text_before_them(pair):
    engine, ar = _oracle_engine(pair, "x = [")
    text = engine.tokenizer.decode(ar)
    stop = text[6:8]
    out = engine.generate(["x = ["], max_new_tokens=40, mode="ddtree", budget=16, stop=stop)[0]
    cut = text.find(stop)
    assert out.text == text[:cut] and out.finish_reason == "stop"
    assert engine.tokenizer.decode(out.token_ids).endswith(stop)  # tokens run through the stop string


def test_abort_frees_slot_and_pages_at_once(engine):
    free = engine.blocks.num_free
    a = engine.add_request([5, 6, 7], SamplingParams(max_new_tokens=50), mode="ddtree", budget=8)
    b = engine.add_request([8, 9], SamplingParams(max_new_tokens=6), mode="chain")
    engine.step()
    assert engine.num_running == 2 and engine.blocks.num_free < free
    engine.abort(a)
    assert engine.num_running == 1
    while engine.has_unfinished():
        engine.step()
    assert engine.take_result(b).finish_reason in ("stop", "length")
    assert engine.blocks.num_free == free and engine.blocks.num_promised == 0
    with pytest.raises(KeyError, match="no request"):
        engine.abort(a)
    queued = engine.add_request([1, 2], SamplingParams(max_new_tokens=3))
    engine.abort(queued)  # still waiting: leaves the queue
    assert not engine.has_unfinished()


def test_more_requests_than_slots_wait_their_turn(engine):
    prompts = [[i + 1, i + 2] for i in range(9)]  # 9 requests, 4 slots
    outs = engine.generate(prompts, max_new_tokens=6, mode="ddtree", budget=4)
    assert len(outs) == 9 and all(1 <= len(o.token_ids) <= 6 for o in outs)
    assert engine.blocks.num_free == engine.blocks.num_pages
    # greedy, float32: each request, whenever its slot came, has the tokens of its prompt run alone with ar
    alone = [engine.generate([p], max_new_tokens=6, mode="ar")[0] for p in prompts]
    assert [o.prompt_token_ids for o in outs] == prompts
    assert [o.token_ids for o in outs] == [a.token_ids for a in alone]


def test_stats_count_experts_and_stages(engine):
    out = engine.generate([[3, 1, 4, 1, 5]], max_new_tokens=10, mode="ar")[0]
    cfg = engine.target.cfg
    assert all(t == [cfg.num_experts_per_tok] * 2 for t in out.stats.experts_touched)  # one row: k experts a layer
    tree = engine.generate([[3, 1, 4, 1, 5]], max_new_tokens=10, mode="ddtree", budget=32)[0]
    assert len(tree.stats.experts_touched) == tree.stats.rounds
    assert max(max(t) for t in tree.stats.experts_touched) > cfg.num_experts_per_tok  # 33 rows touch more
    assert all(c <= cfg.n_routed_experts for t in tree.stats.experts_touched for c in t)
    assert set(tree.stats.stage_seconds) == {"prefill", "draft", "topk", "build", "verify", "accept", "commit", "round"}
    assert tree.stats.stage_seconds["round"] == 0  # eager rounds: "round" counts CUDA-graph replays only
    assert tree.stats.stage_seconds["verify"] > 0 and tree.stats.tokens_per_s > 0


def test_drafter_context_tracks_the_committed_prefix(pair):
    # overlap=False: each step reads its own round, so host and device agree after every step
    # (with overlap the host trails by the round in flight; tests/engine/test_overlap.py).
    engine = Engine.from_pretrained(*pair, device="cpu", page_size=8, max_batch=4, max_model_len=256, overlap=False)
    rid = engine.add_request([4, 5, 6, 7], SamplingParams(max_new_tokens=30, ignore_eos=True), mode="ddtree", budget=8)
    for _ in range(4):
        engine.step()
        request = engine._requests[rid]
        slot = request.slot
        assert int(engine.state.drafter.lengths[slot]) == int(engine.state.prefix_lens[slot]) == request.prefix_len
        assert request.prefix_len == 4 + len(request.output) - 1  # the bonus is not in the cache yet
    engine.abort(rid)


def test_bad_requests_are_refused_before_they_queue(engine):
    cases = [
        (dict(prompt=[]), "prompt is empty"),
        (dict(prompt=[1, 96]), r"token ids must be ints in \[0, 96\)"),
        (dict(prompt=[1], mode="beam"), "mode must be one of"),
        (dict(prompt=[1], budget=0), r"budget must be \"auto\" or an int in \[1, max_budget=256\]"),
        (dict(prompt=[1], budget="big"), r"budget must be \"auto\" or an int"),
        (dict(prompt=[1] * 250, params=SamplingParams(max_new_tokens=10)), "exceeds max_model_len=256"),
    ]
    for kwargs, match in cases:
        with pytest.raises(ValueError, match=match):
            engine.add_request(kwargs.pop("prompt"), **kwargs)
    assert not engine.has_unfinished()
    with pytest.raises(ValueError, match="needs a drafter"):
        Engine(engine.target, None, page_size=8).add_request([1], mode="chain")


def test_a_request_larger_than_the_cache_is_named(pair):
    target = load_target(pair[0], dtype=torch.float32)
    small = Engine(target, None, page_size=8, num_pages=4, max_model_len=256)
    with pytest.raises(KVCacheFull, match=r"request big may need 5 KV pages .* num_pages=4"):
        small.add_request([1] * 20, SamplingParams(max_new_tokens=20), mode="ar", request_id="big")
    assert small.generate([[1, 2]], max_new_tokens=4, mode="ar")[0].token_ids  # still serves what fits


def test_generate_is_all_or_nothing(engine):
    with pytest.raises(ValueError, match="prompt is empty"):
        engine.generate([[1, 2], []], max_new_tokens=4)
    assert not engine.has_unfinished()
    with pytest.raises(ValueError, match="temperature has 1 entries for 2 prompts"):
        engine.generate([[1], [2]], temperature=[0.5])


def test_rounds_build_no_autograd_graph(engine):
    """Cache writes from weights that required grad once chained every round's activations into
    an autograd graph through the caches (gigabytes per generate call on the demo pair)."""
    engine.generate([[5, 6, 7, 8], [9, 10]], max_new_tokens=12, mode="ddtree", budget=8)
    engine.generate([[5, 6, 7, 8]], max_new_tokens=6, mode="ar")
    assert not any(p.requires_grad for p in engine.target.parameters())
    assert not any(p.requires_grad for p in engine.drafter.parameters())
    state = engine.state.drafter
    for t in [*engine.caches, *state.keys, *state.values]:
        assert not t.requires_grad and t.grad_fn is None


def test_request_state_and_abort_in_every_state(engine):
    free = engine.blocks.num_free
    slots = engine.max_batch
    ids = [engine.add_request([3 + i, 4], SamplingParams(max_new_tokens=2), mode="ar") for i in range(slots + 1)]
    assert {engine.request_state(r) for r in ids} == {"waiting"}
    engine.step()
    states = [engine.request_state(r) for r in ids]
    assert states[-1] == "waiting" and set(states[:-1]) <= {"running", "finished"}
    while engine.request_state(ids[0]) != "finished":
        engine.step()
    engine.abort(ids[0])  # finished, result not taken: discarded, no error
    with pytest.raises(KeyError, match="no request"):
        engine.request_state(ids[0])
    for rid in ids[1:]:
        engine.abort(rid)  # running or waiting
    assert not engine.has_unfinished()
    assert engine.blocks.num_free == free and engine.blocks.num_promised == 0


def _commit_one_by_one(request, tokens):
    """Request.commit's rule, token by token: the token is kept, then a stop token or a stop string
    ends the request ("stop"), else max_new_tokens does ("length")."""
    kept = []
    for token in tokens:
        kept.append(token)
        request.output.append(token)
        hit = request.text.add(token)
        if token in request.stop_ids or hit:
            request.finish_reason = "stop"
        elif len(request.output) >= request.params.max_new_tokens:
            request.finish_reason = "length"
        if request.finished:
            break
    return kept


@pytest.mark.parametrize("seed", range(8))
def test_commit_keeps_what_the_token_by_token_rule_keeps(engine, seed):
    """Request.commit (a path's tokens at once) against the rule token by token: a stop string, a
    stop token, both, or max_new_tokens ending the request, inside paths of random lengths (seeds
    0-3) or one path of every token (4-7)."""
    from ddtree.engine.request import Request

    rng = random.Random(seed)
    ids = engine.tokenize("x = compute(alpha, beta) + 1  # ✓ café 日本語\nprint(x)" * 2)
    max_new = rng.randrange(8, len(ids))
    kind = ("string", "token", "both", "length")[seed % 4]
    stop_ids = frozenset({ids[rng.randrange(2, max_new)]}) if kind in ("token", "both") else frozenset()
    text = engine.tokenizer.decode(ids[:max_new])
    start = rng.randrange(len(text) - 3)
    stop = (text[start : start + rng.randrange(1, 4)],) if kind in ("string", "both") else ()
    params = SamplingParams(max_new_tokens=max_new, stop=stop)
    one, many = (Request("r", [1], params, "ar", 1, 0, stop_ids, engine.tokenizer) for _ in range(2))
    i = 0
    while not many.finished:
        path = ids[i : i + (rng.randrange(1, 9) if seed < 4 else len(ids))]
        assert many.commit(path) == _commit_one_by_one(one, path)
        assert (many.output, many.finish_reason, many.text.text) == (one.output, one.finish_reason, one.text.text)
        i += len(path)
    assert many.finish_reason == ("length" if kind == "length" else "stop")
