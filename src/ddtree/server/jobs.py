"""What passes between the HTTP side and the scheduler thread: a Job in, events out.

The HTTP side (the asyncio loop) builds a Job from a validated body and gets a Handle; the
scheduler thread pushes events into the handle's asyncio queue with call_soon_threadsafe, so the
two sides share no lock and the HTTP side never waits on the model.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field, fields
from operator import attrgetter

from .errors import APIError


@dataclass
class Job:
    """One request for the engine. prompt: text or token ids (completions) or None; messages:
    role / content dicts for the chat template (chat) or None; max_tokens: None = the rest of the
    context; sampling: temperature, top_p, top_k, seed, stop, ignore_eos; limit_param: the field
    that set max_tokens, named in errors; encoded_from: the field ("prompt" or "messages") whose
    text the HTTP process already encoded into `prompt`'s ids (an engine-core process), or None."""

    request_id: str
    prompt: str | list[int] | None
    messages: list[dict] | None
    max_tokens: int | None
    sampling: dict
    mode: str
    budget: int | str
    limit_param: str = "max_tokens"
    encoded_from: str | None = None

    @property
    def prompt_param(self) -> str:
        return self.encoded_from or ("messages" if self.messages is not None else "prompt")


@dataclass
class Usage:
    """OpenAI's token counts, plus the acceptance statistics of the ddtree extension."""

    prompt_tokens: int
    completion_tokens: int
    mode: str
    budget: int | str | None
    rounds: int = 0
    mean_acceptance_length: float = 0.0
    seed: int | None = None

    def as_dict(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens,
                "ddtree": {"mode": self.mode, "budget": self.budget, "rounds": self.rounds,
                           "mean_acceptance_length": round(self.mean_acceptance_length, 4), "seed": self.seed}}


@dataclass
class Accepted:
    """The engine took the request (it is queued or running)."""

    prompt_tokens: int


@dataclass
class Chunk:
    """Tokens one step committed: their text, their count, and on the last chunk why it ended
    and the final usage. usage on other chunks: counts so far (statistics not final). token_ids:
    the tokens themselves (an engine core that does not decode sends these, its text empty)."""

    text: str
    num_tokens: int
    usage: Usage
    finish_reason: str | None = None
    token_ids: tuple[int, ...] = ()

    def then(self, later: Chunk) -> Chunk:
        """This chunk and the request's next one as one: text joined, tokens counted, the later's
        usage and finish_reason."""
        return Chunk(self.text + later.text, self.num_tokens + later.num_tokens, later.usage, later.finish_reason,
                     self.token_ids + later.token_ids)


usage_fields = attrgetter(*(f.name for f in fields(Usage)))  # a usage's fields, in order (server/wire.py)


@dataclass
class Failed:
    """The request ended with an error (before or after it was accepted)."""

    error: APIError


@dataclass
class Handle:
    """The HTTP side's end of a job: events arrive in `queue`, pushed from any thread."""

    request_id: str
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    held: object | None = None  # an event coalesce took from the queue and could not merge

    def push(self, event) -> None:
        """Thread-safe: deliver one event to the loop (dropped if the loop is gone)."""
        push_all([(self, event)])

    def push_chunk(self, text: str, num_tokens: int, usage: tuple, finish_reason: str | None,
                   token_ids: tuple[int, ...]) -> None:
        """push a Chunk of these fields (usage: Usage's fields in order; server/wire.py)."""
        self.push(Chunk(text, num_tokens, Usage(*usage), finish_reason, token_ids))

    async def next(self):
        if self.held is not None:
            event, self.held = self.held, None
            return event
        return await self.queue.get()

    def coalesce(self, chunk: Chunk) -> Chunk:
        """`chunk` and the chunks already queued behind it, as one chunk (in order: their text
        joined, their tokens counted, the last one's usage and finish_reason): a client reading
        slower than rounds commit gets what is pending in one event, as vLLM's stream interval
        does. Stops at the last chunk or at an event of another kind, which next() returns."""
        while chunk.finish_reason is None and self.held is None and not self.queue.empty():
            event = self.queue.get_nowait()
            if isinstance(event, Chunk):
                chunk = chunk.then(event)
            else:
                self.held = event
        return chunk


def push_all(events: list[tuple[Handle, object]]) -> None:
    """Thread-safe: deliver (handle, event) pairs in order, one wake-up of each handle's loop for
    all of them (a wake-up writes to the loop's self-pipe: one per event was a system call per
    token at a turn of 64 streams); dropped where the loop is gone."""
    by_loop: dict[asyncio.AbstractEventLoop, list] = {}
    for handle, event in events:
        by_loop.setdefault(handle.loop, []).append((handle, event))
    try:
        running = asyncio.get_running_loop()
    except RuntimeError:
        running = None
    for loop, pairs in by_loop.items():
        if loop is running:  # pushed from the loop itself (the engine core's receiver task): no wake-up
            _put_all(pairs)
            continue
        try:
            loop.call_soon_threadsafe(_put_all, pairs)
        except RuntimeError:  # the event loop closed (server shutting down): nobody is listening
            pass


def _put_all(pairs: list[tuple[Handle, object]]) -> None:
    for handle, event in pairs:
        handle.queue.put_nowait(event)
