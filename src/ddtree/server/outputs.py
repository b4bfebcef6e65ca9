"""A request's text in the HTTP process, when the engine core sends token ids only.

As vLLM's output processor does, the HTTP process decodes what the engine-core process committed
and finds the stop strings in it: the core's turn stays free of per-token text work. A request
whose text reaches a stop string ends here, with the engine's own rule (engine/request.py's
commit: the tokens up to the one that completed it are kept, the text is cut before it), and the
core is told to abort it; what the core commits for it after that is dropped.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..engine.text import TextStream
from .jobs import Chunk


@dataclass
class _Output:
    text: TextStream | None  # None without a tokenizer: the core's text (if it decodes), its stop strings
    produced: int = 0


class TextOutputs:
    """Per open request, its TextStream; not thread-safe (engine_core.EngineCore holds its lock)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._open: dict[str, _Output] = {}

    def open(self, request_id: str, stop: tuple[str, ...]) -> None:
        stream = TextStream(self.tokenizer, tuple(stop)) if self.tokenizer is not None else None
        self._open[request_id] = _Output(stream)

    def close(self, request_id: str) -> None:
        self._open.pop(request_id, None)

    def clear(self) -> None:
        self._open.clear()

    def process(self, request_id: str, chunk: Chunk) -> tuple[Chunk, bool]:
        """The core's chunk (token ids) as the client's: its text, the tokens kept, the count so
        far in its usage; True when a stop string ended the request here (the core must abort
        it). A final chunk (or a stop) closes the request. `chunk` and its usage are this call's
        to change (the receiver built them from the wire) and are returned changed."""
        output = self._open[request_id]
        stream, tokens = output.text, chunk.token_ids
        stopped = False
        if stream is not None:
            taken = stream.extend(tokens)
            stopped = stream.stopped
            if taken < len(tokens):
                tokens = tokens[:taken]
        output.produced += len(tokens)
        final = stopped or chunk.finish_reason is not None
        if stream is not None:
            chunk.text = stream.delta(final=final)
        if final:
            self.close(request_id)
        chunk.usage.completion_tokens = output.produced
        chunk.num_tokens, chunk.token_ids = len(tokens), tokens
        if stopped:
            chunk.finish_reason = "stop"
        return chunk, stopped
