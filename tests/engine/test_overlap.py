"""Overlapped steps (a round's tokens read while the next round runs) commit exactly what
step-by-step rounds commit, and a request the host has not yet seen finish cannot outgrow it."""

import pytest

pytest.importorskip("transformers")

from ddtree import Engine, SamplingParams  # noqa: E402

from .pairs import EOS, make_pair, prompts  # noqa: E402


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    target_dir, drafter_dir, _ = make_pair(tmp_path_factory.mktemp("pair"), tokenizer=True, block_size=8, eos_token_id=EOS)
    return target_dir, drafter_dir


def _engine(pair, overlap: bool, **kwargs) -> Engine:
    kwargs = dict(max_model_len=256, device="cpu") | kwargs
    return Engine.from_pretrained(*pair, page_size=8, max_batch=4, overlap=overlap, **kwargs)


@pytest.mark.parametrize("mode,budget,temperature", [("ar", 1, 0.0), ("chain", 1, 0.0), ("ddtree", 12, 0.0),
                                                     ("ddtree", 12, 1.0)])
def test_overlapped_steps_equal_step_by_step(pair, mode, budget, temperature):
    batch = prompts(7, 96, seed=4, lengths=(2, 20))  # more requests than slots: some join mid-run
    lengths = [3, 17, 1, 30, 9, 24, 5]  # finish at different rounds, one at its prefill
    args = dict(max_new_tokens=lengths, mode=mode, budget=budget, temperature=temperature, seed=list(range(7)))
    want = _engine(pair, overlap=False).generate(batch, **args)
    engine = _engine(pair, overlap=True)
    got = engine.generate(batch, **args)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert [o.finish_reason for o in got] == [o.finish_reason for o in want]
    assert [o.stats.acceptance_lengths for o in got] == [o.stats.acceptance_lengths for o in want]
    while engine.has_unfinished():  # the round launched after the last request ended
        assert engine.step() == []
    assert engine.blocks.num_free == engine.blocks.num_pages


@pytest.mark.parametrize("overlap", [False, True])
def test_a_prefill_is_read_only_after_the_next_round_is_launched(pair, overlap):
    """A step that admits launches its round before it reads the prefill's first tokens (reading
    them first left the device idle while the host launched the round), and those tokens still
    come out in that step; a request whose prefill commits its last token takes no round."""
    from ddtree.engine import inflight

    engine = _engine(pair, overlap=overlap)
    order, read = [], inflight.Admission.tokens
    round_ = engine.worker.round
    engine.worker.round = lambda *args, **kw: order.append("round") or round_(*args, **kw)
    inflight.Admission.tokens = lambda self: order.append("read") or read(self)
    try:
        first = engine.add_request([5, 9, 11], SamplingParams(max_new_tokens=6), mode="ddtree", budget=8)
        outs = engine.step()
        assert order == ["round", "read"]
        (count,) = [len(o.new_token_ids) for o in outs if o.request_id == first]
        assert count == 1 if overlap else count >= 2  # without overlap the round's tokens join it
        while engine.has_unfinished():
            engine.step()
        order.clear()
        alone = engine.add_request([7, 8], SamplingParams(max_new_tokens=1), mode="ddtree", budget=8)
        outs = engine.step()
        assert order == ["read"] and [(o.request_id, len(o.new_token_ids), o.finished) for o in outs] == [(alone, 1, True)]
    finally:
        inflight.Admission.tokens = read
    assert engine.blocks.num_free == engine.blocks.num_pages


def test_stop_strings_seen_one_round_late_change_nothing(pair):
    plain = _engine(pair, overlap=False)
    free = plain.generate(["hello"], max_new_tokens=40, mode="ddtree", budget=8)[0]
    stop = free.text[5:8]  # a string the free-running text contains
    want = plain.generate(["hello"], max_new_tokens=40, mode="ddtree", budget=8, stop=stop)[0]
    got = _engine(pair, overlap=True).generate(["hello"], max_new_tokens=40, mode="ddtree", budget=8, stop=stop)[0]
    assert got.finish_reason == want.finish_reason == "stop"
    assert got.text == want.text and got.token_ids == want.token_ids


def test_a_request_ended_on_the_host_takes_no_part_on_the_device(pair):
    """While the host still reads round k, round k + 1 is already launched: a request that hit
    max_new_tokens in round k must not commit in round k + 1 (BatchState.remaining)."""
    engine = _engine(pair, overlap=True)
    rid = engine.add_request([5, 6, 7], SamplingParams(max_new_tokens=4, ignore_eos=True), mode="ddtree", budget=8)
    steps = 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
    out = engine.take_result(rid)
    assert len(out.token_ids) == 4 and steps >= 2
    slot_prefix = 3 + 4 - 1  # prompt + tokens - the last bonus: the most the device may hold
    assert int(engine.state.prefix_lens.max()) <= slot_prefix + engine.max_depth  # at most one round past


def test_abort_with_a_round_in_flight_frees_everything(pair):
    engine = _engine(pair, overlap=True)
    ids = [engine.add_request(p, SamplingParams(max_new_tokens=50, ignore_eos=True), mode="ddtree", budget=8)
           for p in prompts(3, 96, seed=2)]
    engine.step()
    engine.step()
    assert engine._inflight is not None
    for rid in ids:
        engine.abort(rid)
    while engine.has_unfinished():
        assert engine.step() == []
    assert engine.blocks.num_free == engine.blocks.num_pages
    again = engine.generate(prompts(2, 96, seed=3), max_new_tokens=10, mode="ddtree", budget=8)
    assert all(len(o.token_ids) == 10 for o in again)


def test_the_round_after_a_request_ends_stays_inside_the_drafter_cache(pair):
    """Full acceptance up to the last token of max_model_len, a prefill chunk below 2 (D + 1):
    the request's last round overshoots by D and the round launched after it (overlap) still
    drafts a block beyond that, which the drafter cache must hold (it raised IndexError)."""
    import torch

    for overlap in (False, True):
        engine = _engine(pair, overlap=overlap, prefill_chunk=4, stop_token_ids=(), max_model_len=64)
        with torch.no_grad():
            engine.target.lm_head.weight.zero_()  # every logit equal: target and drafter agree, full acceptance
        rid = engine.add_request(list(range(1, 15)), SamplingParams(max_new_tokens=50, ignore_eos=True), mode="chain")
        while engine.has_unfinished():
            engine.step()
        out = engine.take_result(rid)
        assert len(out.token_ids) == 50 and max(out.stats.acceptance_lengths) == engine.max_depth + 1


@pytest.mark.cuda
@pytest.mark.parametrize("cuda_graphs", [False, True], ids=["eager", "graphs"])
def test_overlap_on_cuda_equals_step_by_step(pair, cuda_graphs):
    """On a GPU the host really runs ahead of the device: same tokens and finishes as without overlap."""
    import torch

    batch = prompts(7, 96, seed=6, lengths=(2, 20))
    args = dict(max_new_tokens=[3, 17, 1, 30, 9, 24, 5], mode="ddtree", budget=12, temperature=1.0, seed=list(range(7)))
    kwargs = dict(device="cuda", dtype=torch.bfloat16, cuda_graphs=cuda_graphs)
    want = _engine(pair, overlap=False, **kwargs).generate(batch, **args)
    engine = _engine(pair, overlap=True, **kwargs)
    got = engine.generate(batch, **args)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert [o.finish_reason for o in got] == [o.finish_reason for o in want]
    while engine.has_unfinished():
        assert engine.step() == []
    assert engine.blocks.num_free == engine.blocks.num_pages
