"""The chunks of a turn as the engine-core process sends them to the HTTP process: plain tuples.

A Chunk travels as (request id, text, num_tokens, its usage's fields, finish_reason, token_ids):
pickling builds and reads tuples in C, where objects cost a Python call each (pickled through a
__reduce__ of their fields, a turn of 64 chunks took about twice as long to dump and seven times as
long to load). The HTTP process builds Chunk objects only after joining a request's chunks of every turn it
takes at once, so a receiver that fell behind builds one per request instead of one per token.
Other events (Accepted, Failed) travel as (request id, event).
"""

from __future__ import annotations

from itertools import chain

from .jobs import Chunk, Usage, usage_fields

# to_wire and joined_from_wire know how each field of a Chunk travels and joins (a test checks the list)
CHUNK_FIELDS = ("text", "num_tokens", "usage", "finish_reason", "token_ids")


def to_wire(events: list[tuple]) -> list[tuple]:
    """A turn's (request id, event) pairs as the socket carries them (the module's docstring); a
    chunk already in that form (the engine core's handles push them so) passes as it is."""
    return [(item[0], e.text, e.num_tokens, usage_fields(e.usage), e.finish_reason, e.token_ids)
            if len(item) == 2 and type(e := item[1]) is Chunk else item for item in events]


def joined_from_wire(items: list[tuple]) -> list[tuple[str, object]]:
    """to_wire's pairs of one or more turns, in order, back as (request id, event), each request's
    consecutive chunks joined into one (text joined, tokens counted, the last one's usage and
    finish_reason, as Chunk.then). A request's events keep their order; a chunk never joins one
    that ended its request or that another kind of event followed."""
    groups: list[tuple[str, object]] = []  # (request id, event) or (request id, [its chunks' tuples])
    growing: dict[str, int] = {}  # request id -> index in groups of its chunks that may grow
    for item in items:
        rid = item[0]
        if len(item) == 2:
            groups.append(item)
            growing.pop(rid, None)
            continue
        at = growing.get(rid)
        if at is None:
            at = len(groups)
            groups.append((rid, [item]))
        else:
            groups[at][1].append(item)
        if item[4] is None:
            growing[rid] = at
        else:
            growing.pop(rid, None)
    return [(rid, _chunk(group) if type(group) is list else group) for rid, group in groups]


def _chunk(group: list[tuple]) -> Chunk:
    _, text, count, usage, finish, token_ids = group[-1]
    if len(group) > 1:
        text = "".join(item[1] for item in group)
        count = sum(item[2] for item in group)
        token_ids = tuple(chain.from_iterable(item[5] for item in group))
    return Chunk(text, count, Usage(*usage), finish, token_ids)
