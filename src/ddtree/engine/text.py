"""Incremental text of a request: decoded as tokens commit, stop strings found, deltas streamed.

A delta never ends inside a multi-byte character (a trailing U+FFFD waits for the next token) or
with text that could be the start of a stop string; the final delta flushes what is left.
"""

from __future__ import annotations


class TextStream:
    def __init__(self, tokenizer, stop: tuple[str, ...] = ()):
        self.tokenizer = tokenizer
        self.stop = stop
        self.tokens: list[int] = []
        self.text = ""
        self._sent = 0

    def add(self, token: int) -> bool:
        """Append one committed token; True when the text now contains a stop string (the text
        is then cut before its first occurrence)."""
        self.tokens.append(token)
        self.text = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
        hits = [i for i in (self.text.find(s) for s in self.stop) if i >= 0]
        if hits:
            self.text = self.text[: min(hits)]
            return True
        return False

    def _held_back(self) -> int:
        """Characters at the end that may still change: an incomplete character, or a proper
        prefix of a stop string."""
        text = self.text
        if text.endswith("\ufffd"):
            return len(text) - len(text.rstrip("\ufffd"))
        longest = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(text)), longest, -1):
                if text.endswith(s[:n]):
                    longest = n
                    break
        return longest

    def delta(self, final: bool = False) -> str:
        """Text not streamed yet (all of it when final)."""
        end = len(self.text) if final else max(self._sent, len(self.text) - self._held_back())
        out = self.text[self._sent : end]
        self._sent = end
        return out
