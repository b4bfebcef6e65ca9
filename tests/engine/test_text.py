"""TextStream: decoding a window per token gives the text a full decode gives (multi-byte
characters split over tokens, random token soup included), stop strings cut it wherever they
span tokens, and the streamed deltas add up to the final text. Each test runs twice: through the
tokenizers library's DecodeStream (the fast tokenizer's path) and through transformers' decode
(any other tokenizer's)."""

import random

import pytest

pytest.importorskip("transformers")

from ddtree.demo import demo_pair  # noqa: E402
from ddtree.engine.loading import load_tokenizer  # noqa: E402
from ddtree.engine.text import TextStream  # noqa: E402


class PythonOnly:
    """The demo tokenizer seen as a tokenizer without a Rust backend (a remote-code one, say)."""

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer
        self.vocab_size = tokenizer.vocab_size

    def __call__(self, text):
        return self._tokenizer(text)

    def decode(self, ids, **kwargs):
        return self._tokenizer.decode(ids, **kwargs)


@pytest.fixture(scope="module", params=["native", "python"])
def tokenizer(request):
    loaded = load_tokenizer(demo_pair()[0])
    return loaded if request.param == "native" else PythonOnly(loaded)


def test_a_fast_tokenizer_streams_through_decode_stream(tokenizer):
    text = TextStream(tokenizer)
    assert (text._native is not None) == (not isinstance(tokenizer, PythonOnly))
    ids = tokenizer("def f(x):\n    return x")["input_ids"]
    for token in ids:
        text.add(token)
    assert text.text == tokenizer.decode(ids, skip_special_tokens=True)
    assert (text._native is not None) == (not isinstance(tokenizer, PythonOnly))  # it stayed on its path


def stream(tokenizer, ids, stop=()):
    text, deltas = TextStream(tokenizer, stop), []
    for i, token in enumerate(ids):
        hit = text.add(token)
        deltas.append(text.delta(final=hit or i == len(ids) - 1))
        if hit:
            break
    return text, "".join(deltas)


@pytest.mark.parametrize("seed", range(6))
def test_windowed_decode_equals_a_full_decode(tokenizer, seed):
    rng = random.Random(seed)
    source = ["def f(x):\n    return x * 2  # ✓ café 日本語 🎉", "".join(chr(rng.randrange(32, 0x2FFF)) for _ in range(80))]
    ids = tokenizer(source[seed % 2])["input_ids"] if seed < 4 else [rng.randrange(tokenizer.vocab_size) for _ in range(200)]
    text, streamed = stream(tokenizer, ids)
    full = tokenizer.decode(ids, skip_special_tokens=True)
    assert text.text == full and streamed == full


def test_stop_strings_cut_across_tokens_and_are_never_streamed(tokenizer):
    ids = tokenizer("value = compute(alpha, beta) + 1\nprint(value)")["input_ids"]
    for stop in ("(alpha, b", "\npr", "+ 1"):
        text, streamed = stream(tokenizer, ids, (stop,))
        full = tokenizer.decode(ids, skip_special_tokens=True)
        assert text.text == full[: full.index(stop)] == streamed


def test_an_unfinished_character_waits_then_flushes(tokenizer):
    ids = tokenizer("🎉")["input_ids"]
    assert len(ids) > 1  # the emoji's bytes span tokens
    text = TextStream(tokenizer)
    text.add(ids[0])
    assert text.delta() == "" and text.text == ""
    assert text.delta(final=True) == tokenizer.decode(ids[:1])  # the replacement character, at the end


def test_a_stop_string_before_half_a_character_ends_the_text_at_once(tokenizer):
    ids = tokenizer("x = 1 …")["input_ids"]  # ' \xe2' is one token: a space and the first byte of '…'
    text = TextStream(tokenizer, ("1 ",))
    first = next(i for i, t in enumerate(ids) if text.add(t))  # a request stops at its hit
    assert tokenizer.decode(ids[: first + 1]).endswith("\ufffd")  # the hit came with half the '…'
    assert text.text == "x = " and text.delta(final=True) == "x = "


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("stop", [(), ("= 1", "日本")])
def test_extend_equals_adding_one_by_one(tokenizer, seed, stop):
    """extend (the HTTP process's way, a chunk at a time) leaves every stream in the state add
    leaves it token by token: text, window, path, stops and deltas, for chunks of any size."""
    rng = random.Random(seed)
    source = "x = 1 … def f(x):\n    return x * 2  # ✓ café 日本語 🎉 " * 2
    ids = tokenizer(source)["input_ids"] if seed < 3 else [rng.randrange(tokenizer.vocab_size) for _ in range(120)]
    one, many = TextStream(tokenizer, stop), TextStream(tokenizer, stop)
    one_deltas, many_deltas, i = [], [], 0
    while i < len(ids) and not many.stopped:
        chunk = ids[i : i + rng.randrange(1, 9)]
        taken = many.extend(chunk)
        hits = [one.add(t) for t in chunk[:taken]]
        assert hits == [False] * (taken - 1) + [many.stopped] and taken == len(chunk) or many.stopped
        i += len(chunk)
        final = many.stopped or i >= len(ids)
        one_deltas.append(one.delta(final=final))
        many_deltas.append(many.delta(final=final))
        state = ("text", "tokens", "_prefix", "_read", "_sent", "_stopped")
        assert [getattr(many, k) for k in state] == [getattr(one, k) for k in state]
        assert (many._native is None) == (one._native is None)
    assert many_deltas == one_deltas and "".join(many_deltas) == many.text
    if not stop:
        assert many.text == tokenizer.decode(ids, skip_special_tokens=True)
