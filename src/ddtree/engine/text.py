"""Incremental text of a request: decoded as tokens commit, stop strings found, deltas streamed.

Each token is decoded with a short window of the tokens before it (a prefix, as vLLM's incremental
detokenizer does), not the whole output again: a token costs the same at position 10 or 10,000.
The new text is what decoding prefix + new tokens adds to decoding the prefix alone, so a
tokenizer that merges across token boundaries (leading spaces, multi-byte characters split over
tokens) gives the text a full decode gives. A token that ends inside a multi-byte character adds
nothing until the character completes. A delta never ends with text that could be the start of a
stop string; the final delta flushes what is left.

With a fast (Rust) tokenizer whose decode adds no clean-up, each token goes through the tokenizers
library's own DecodeStream, which runs that same algorithm in one native call (about 20x less host
time per token than two decodes through transformers' wrapper; detokenizing was the largest host
cost of a step). Tokens it holds back (half a character, a special token) take the path above,
so that a stop string completed before half a character is still found at its token.
"""

from __future__ import annotations

try:
    from tokenizers.decoders import DecodeStream
except ImportError:  # tokenizers < 0.21
    DecodeStream = None


def fast_backend(tokenizer):
    """The tokenizers.Tokenizer whose decode equals `tokenizer.decode` (a fast tokenizer without
    clean-up of spaces), or None."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return None
    return backend


class TextStream:
    def __init__(self, tokenizer, stop: tuple[str, ...] = ()):
        self.tokenizer = tokenizer
        self.stop = stop
        self._backend = fast_backend(tokenizer)
        self._native = DecodeStream(skip_special_tokens=True) if self._backend is not None and DecodeStream else None
        self.tokens: list[int] = []
        self.text = ""
        self._sent = 0
        self._prefix = 0  # tokens[_prefix:_read] is the window decoded before the new tokens
        self._read = 0
        self._stopped = False  # a stop string ended the text: nothing after it is decoded

    def _decode(self, tokens: list[int]) -> str:
        if self._backend is not None:
            return self._backend.decode(tokens, skip_special_tokens=True)
        return self.tokenizer.decode(tokens, skip_special_tokens=True)

    @property
    def stopped(self) -> bool:
        """A stop string ended the text."""
        return self._stopped

    def add(self, token: int) -> bool:
        """Append one committed token; True when the text now contains a stop string (the text
        is then cut before its first occurrence)."""
        self.tokens.append(token)
        new = self._native_step(token) if self._native is not None else None
        return self._append(new) if new is not None else self._add_held_back()

    def extend(self, tokens) -> int:
        """Append committed tokens in order, as add() one by one, until one completes a stop
        string; returns how many were taken (all of them unless a stop string ended the text).
        Without stop strings, the native decoder's text is joined once for all of them."""
        if self.stop:
            for i, token in enumerate(tokens):
                if self.add(token):
                    return i + 1
            return len(tokens)
        pieces = []
        for i, token in enumerate(tokens):
            if self._native is None:  # the Python path from here (it never stops: no stop strings)
                self.text += "".join(pieces)
                for rest in tokens[i:]:
                    self.add(rest)
                return len(tokens)
            self.tokens.append(token)
            new = self._native_step(token)
            if new is None:  # held back or failed: add's Python path, with the text up to date
                self.text += "".join(pieces)
                pieces = []
                self._add_held_back()
                continue
            pieces.append(new)
            self._prefix, self._read = self._read, len(self.tokens)  # as _append moves the window
        self.text += "".join(pieces)
        return len(tokens)

    def _native_step(self, token: int) -> str | None:
        try:
            return self._native.step(self._backend, token)  # the same window as _unread_text's
        except Exception:  # a tokenizer whose prefixes do not decode to prefixes: the Python path
            self._native = None
            return None

    def _add_held_back(self) -> bool:
        """add() for a token the native decoder printed nothing for (or without it)."""
        new = self._unread_text()
        if not new or new.endswith("\ufffd"):
            # nothing printable yet (a special token, or half a character): but what is complete
            # before the half character may already finish a stop string
            complete = new.rstrip("\ufffd")
            cut = first_stop(self.text + complete, len(self.text), self.stop) if complete else None
            if cut is None:
                return False
            self.text, self._stopped = (self.text + complete)[:cut], True
            return True
        self._native = None  # it held back what the Python path prints: their windows would part
        return self._append(new)

    def _unread_text(self) -> str:
        """What the tokens past the window add to its text (may end in half a character)."""
        before = self._decode(self.tokens[self._prefix : self._read])
        return self._decode(self.tokens[self._prefix :])[len(before) :]

    def _append(self, new: str) -> bool:
        """Take `new` (the unread tokens' text) into the text, move the window on, cut at a stop."""
        start = len(self.text)
        self.text += new
        self._prefix, self._read = self._read, len(self.tokens)
        return self._cut_at_stop(start)

    def _cut_at_stop(self, start: int) -> bool:
        """Cut the text before the first stop string ending at or after `start`; True if cut."""
        cut = first_stop(self.text, start, self.stop)
        if cut is not None:
            self.text, self._stopped = self.text[:cut], True
        return cut is not None

    def _held_back(self) -> int:
        """Characters at the end that may still change: a proper prefix of a stop string."""
        text, longest = self.text, 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(text)), longest, -1):
                if text.endswith(s[:n]):
                    longest = n
                    break
        return longest

    def delta(self, final: bool = False) -> str:
        """Text not streamed yet (all of it when final, an unfinished character included)."""
        if final and self._read < len(self.tokens) and not self._stopped:
            self._append(self._unread_text())
        end = len(self.text) if final else max(self._sent, len(self.text) - self._held_back())
        out = self.text[self._sent : end]
        self._sent = end
        return out


def first_stop(text: str, start: int, stops: tuple[str, ...]) -> int | None:
    """Where the first stop string in `text` begins, among those that end at or after `start`
    (the text before `start` was searched already); None if there is none."""
    if not stops:
        return None
    hits = [i for i in (text.find(s, max(0, start - len(s) + 1)) for s in stops) if i >= 0]
    return min(hits) if hits else None
