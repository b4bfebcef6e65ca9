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
