"""The HTTP process's text (server/outputs.py), for an engine core that sends token ids: the text,
the stop strings and the token counts are the engine's own, whatever the chunks' boundaries."""

import pytest

from ddtree import SamplingParams
from ddtree.server.jobs import Chunk, Usage
from ddtree.server.outputs import TextOutputs

from .test_api import served_alone


def _chunks(tokens: list[int], size: int, finish: str) -> list[Chunk]:
    parts = [tokens[i : i + size] for i in range(0, len(tokens), size)]
    return [Chunk("", len(p), Usage(3, 0, "ar", None), finish if i == len(parts) - 1 else None, tuple(p))
            for i, p in enumerate(parts)]


@pytest.mark.parametrize("size", [1, 3, 7])
def test_a_stop_string_ends_the_text_as_the_engine_ends_it(reference, size):
    whole = served_alone(reference, "x = [1, 2", 30, mode="ar")
    stop = whole.text[3:5]  # reached by the greedy continuation
    alone = served_alone(reference, "x = [1, 2", 30, mode="ar", stop=[stop])
    assert alone.finish_reason == "stop" and len(alone.token_ids) < len(whole.token_ids)
    outputs = TextOutputs(reference.tokenizer)
    outputs.open("r", (stop,))
    text, tokens, last = "", [], None
    for chunk in _chunks(whole.token_ids, size, whole.finish_reason):
        last, stopped = outputs.process("r", chunk)
        text, tokens = text + last.text, tokens + list(last.token_ids)
        if stopped:
            break
    assert stopped and (text, tokens, last.finish_reason) == (alone.text, alone.token_ids, "stop")
    assert last.usage.completion_tokens == len(alone.token_ids)
    with pytest.raises(KeyError):  # closed: what the core commits after the stop is dropped by its caller
        outputs.process("r", _chunks(whole.token_ids, size, "length")[-1])


def test_without_a_stop_the_text_is_the_engine_s_and_the_core_says_why_it_ended(reference):
    alone = served_alone(reference, "def fib(n):", 12, mode="ar")
    outputs = TextOutputs(reference.tokenizer)
    outputs.open("r", ())
    got = [outputs.process("r", c) for c in _chunks(alone.token_ids, 5, alone.finish_reason)]
    assert "".join(c.text for c, _ in got) == alone.text and not any(s for _, s in got)
    assert got[-1][0].finish_reason == alone.finish_reason and got[-1][0].usage.completion_tokens == 12
    bare = TextOutputs(None)  # a model without a tokenizer: token ids only
    bare.open("r", ())
    chunk, stopped = bare.process("r", _chunks([5, 6], 2, "length")[0])
    assert (chunk.text, chunk.token_ids, chunk.finish_reason, stopped) == ("", (5, 6), "length", False)


def test_an_engine_that_does_not_decode_leaves_text_and_stop_strings_to_its_caller(reference):
    with pytest.raises(ValueError, match="stop strings need the engine's text"):
        reference.add_request("ab", SamplingParams(max_new_tokens=4, stop=("x",)), detokenize=False)
    rid = reference.add_request("def fib(n):", SamplingParams(max_new_tokens=6), mode="ar", detokenize=False)
    texts = []
    while reference.request_state(rid) != "finished":
        texts += [o.new_text for o in reference.step() if o.request_id == rid]
    out = reference.take_result(rid)
    assert set(texts) == {None} and out.text is None
    assert out.token_ids == served_alone(reference, "def fib(n):", 6, mode="ar").token_ids


def test_text_the_http_process_cannot_encode_is_a_400_before_the_core_sees_it():
    """An engine-core server encodes prompts in the HTTP process: without a tokenizer a text prompt
    is refused there, naming the field, and nothing is sent to the core."""
    from ddtree.server.engine_core import EngineCore
    from ddtree.server.errors import APIError
    from ddtree.server.jobs import Job

    core = EngineCore(build=None, facts_of=None)  # never launched: its tokenizer is None
    for job, param in ((Job("r", "some text", None, 4, {}, "ar", 1), "prompt"),
                       (Job("r", None, [{"role": "user", "content": "hi"}], 4, {}, "ar", 1), "messages")):
        with pytest.raises(APIError) as err:
            core.submit(job, loop=None)
        assert (err.value.status, err.value.param) == (400, param)
