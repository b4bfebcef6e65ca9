"""A client that reads slower than rounds commit gets its pending chunks as one event."""

import asyncio

import pytest

pytest.importorskip("fastapi")

from ddtree.server.errors import APIError  # noqa: E402
from ddtree.server.jobs import Chunk, Failed, Handle, Usage  # noqa: E402


def usage(tokens: int) -> Usage:
    return Usage(prompt_tokens=3, completion_tokens=tokens, mode="ddtree", budget="auto")


def test_pending_chunks_merge_in_order_up_to_the_last():
    async def run():
        handle = Handle("r", asyncio.get_running_loop())
        for i, (text, n) in enumerate([("a", 1), ("bc", 2), ("", 1), ("d", 1)]):
            handle.queue.put_nowait(Chunk(text, n, usage(sum([1, 2, 1, 1][: i + 1]))))
        handle.queue.put_nowait(Chunk("e", 1, usage(6), finish_reason="stop"))
        handle.queue.put_nowait(Chunk("never", 1, usage(7)))  # after the last chunk: not merged into it
        merged = handle.coalesce(await handle.next())
        assert (merged.text, merged.num_tokens, merged.finish_reason) == ("abcde", 6, "stop")
        assert merged.usage.completion_tokens == 6
        assert (await handle.next()).text == "never"

    asyncio.run(run())


def test_an_error_behind_the_chunks_ends_the_merge_and_comes_next():
    async def run():
        handle = Handle("r", asyncio.get_running_loop())
        handle.queue.put_nowait(Chunk("a", 1, usage(1)))
        handle.queue.put_nowait(Chunk("b", 1, usage(2)))
        failed = Failed(APIError(500, "boom"))
        handle.queue.put_nowait(failed)
        handle.queue.put_nowait(Chunk("c", 1, usage(3)))
        merged = handle.coalesce(await handle.next())
        assert (merged.text, merged.num_tokens, merged.finish_reason) == ("ab", 2, None)
        assert handle.coalesce(merged) is merged  # the error is held: nothing more merges
        assert await handle.next() is failed
        assert (await handle.next()).text == "c"
        alone = Chunk("x", 1, usage(4))
        assert handle.coalesce(alone) is alone  # nothing pending: the chunk as it came

    asyncio.run(run())


def test_turns_a_receiver_fell_behind_on_join_each_requests_chunks_in_order():
    """Three turns of the core, routed at once: a's chunks become one, b's too up to its last chunk
    (the chunk after it stays apart), c's chunk does not join across its Failed, Accepted stays first."""
    from ddtree.server.jobs import Accepted, joined_turns

    failed = Failed(APIError(500, "boom"))
    turns = [("a", Chunk("", 1, usage(1), token_ids=(5,))), ("b", Accepted(3)), ("c", Chunk("x", 1, usage(1))),
             ("a", Chunk("", 2, usage(3), token_ids=(6, 7))), ("b", Chunk("y", 1, usage(1))), ("c", failed),
             ("b", Chunk("z", 1, usage(2), finish_reason="length")), ("c", Chunk("w", 1, usage(2))),
             ("a", Chunk("", 1, usage(4), token_ids=(8,))), ("b", Chunk("late", 1, usage(3)))]
    out = joined_turns(turns)
    by_request = {rid: [e for r, e in out if r == rid] for rid in "abc"}
    (a,) = by_request["a"]
    assert (a.token_ids, a.num_tokens, a.usage.completion_tokens, a.finish_reason) == ((5, 6, 7, 8), 4, 4, None)
    accepted, b, late = by_request["b"]
    assert isinstance(accepted, Accepted)
    assert (b.text, b.num_tokens, b.finish_reason, late.text) == ("yz", 2, "length", "late")
    assert [getattr(e, "text", e) for e in by_request["c"]] == ["x", failed, "w"]
    assert joined_turns([]) == [] and joined_turns(turns[:1]) == turns[:1]
