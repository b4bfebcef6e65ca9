"""What the engine-core process sends per turn: chunks as plain tuples (server/wire.py), joined per
request when the HTTP side takes several turns at once; the turn's counter increments summed into
one update per counter."""

import pickle
from dataclasses import fields

from ddtree.server.core_process import _Outbox, _RecordedMetrics
from ddtree.server.errors import APIError
from ddtree.server.jobs import Accepted, Chunk, Failed, Usage
from ddtree.server.wire import CHUNK_FIELDS, joined_from_wire, to_wire


def usage(tokens: int) -> Usage:
    return Usage(3, tokens, "ddtree", "auto", tokens, 1.25, seed=9)


def test_a_turn_survives_the_wire_event_for_event():
    turn = [("a", Chunk("é\n", 2, usage(2), None, (5, 6))), ("b", Accepted(4)), ("c", Chunk("", 1, usage(1), "stop", (7,))),
            ("d", Failed(APIError(500, "boom")))]
    back = joined_from_wire(pickle.loads(pickle.dumps(to_wire(turn))))
    assert [rid for rid, _ in back] == ["a", "b", "c", "d"]
    assert back[0][1] == turn[0][1] and back[2][1] == turn[2][1] and type(back[0][1].usage) is Usage
    assert back[1][1] == turn[1][1] and back[3][1].error.status == 500


def test_turns_taken_at_once_join_each_requests_chunks_in_order():
    """Three turns routed at once: a's chunks become one, b's too up to its last chunk (the chunk
    after it stays apart), c's chunk does not join across its Failed, Accepted stays first."""
    failed = Failed(APIError(500, "boom"))
    turns = [("a", Chunk("", 1, usage(1), token_ids=(5,))), ("b", Accepted(3)), ("c", Chunk("x", 1, usage(1))),
             ("a", Chunk("", 2, usage(3), token_ids=(6, 7))), ("b", Chunk("y", 1, usage(1))), ("c", failed),
             ("b", Chunk("z", 1, usage(2), finish_reason="length")), ("c", Chunk("w", 1, usage(2))),
             ("a", Chunk("", 1, usage(4), token_ids=(8,))), ("b", Chunk("late", 1, usage(3)))]
    out = joined_from_wire(to_wire(turns))
    by_request = {rid: [e for r, e in out if r == rid] for rid in "abc"}
    (a,) = by_request["a"]
    assert (a.token_ids, a.num_tokens, a.usage, a.finish_reason) == ((5, 6, 7, 8), 4, usage(4), None)
    accepted, b, late = by_request["b"]
    assert isinstance(accepted, Accepted)
    assert (b.text, b.num_tokens, b.finish_reason, b.usage, late.text) == ("yz", 2, "length", usage(2), "late")
    assert [getattr(e, "text", e) for e in by_request["c"]] == ["x", failed, "w"]
    assert joined_from_wire([]) == [] and joined_from_wire(to_wire(turns[:1])) == turns[:1]
    joined = turns[0][1].then(turns[3][1]).then(turns[8][1])  # what the HTTP loop's coalesce would make
    assert a == joined


def test_the_wire_knows_every_field_of_a_chunk_and_of_its_usage():
    """A field added to Chunk must be added to server/wire.py, which sends and joins them by name."""
    assert tuple(f.name for f in fields(Chunk)) == CHUNK_FIELDS
    usage = Usage(7, 3, "ddtree", "auto", 2, 1.5, seed=11)
    (back,) = joined_from_wire(pickle.loads(pickle.dumps(to_wire([("r", Chunk("é\n", 3, usage, "stop", (1, 2, 3)))]))))
    assert back == ("r", Chunk("é\n", 3, usage, "stop", (1, 2, 3))) and back[1].usage is not usage


def test_a_turns_counter_increments_are_one_update_each_and_observations_stay():
    outbox = _Outbox()
    metrics = _RecordedMetrics(outbox)
    for count in (1, 4, 2):
        metrics.generated_tokens.inc(count)
    metrics.time_to_first_token.observe(0.25)
    metrics.engine_step_failures.inc()
    metrics.time_to_first_token.observe(0.5)
    _, updates = outbox.take()
    assert updates == [("generated_tokens", "inc", 7), ("engine_step_failures", "inc", 1),
                       ("time_to_first_token", "observe", 0.25), ("time_to_first_token", "observe", 0.5)]
    assert outbox.take() == ([], [])  # taken: the next turn starts empty
