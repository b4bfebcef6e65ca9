"""The HTTP process's receiver of the engine core's turns, as a task of the app's loop, against a
stand-in core (a ZeroMQ PUSH socket in this process): a backlog of more turns than one wake-up
takes reaches every request in order, chunks before a `died` message are delivered before the
failure, and stop() leaves no watch on the socket behind."""

from __future__ import annotations

import asyncio
import tempfile

import pytest

pytest.importorskip("zmq")

import zmq  # noqa: E402

from ddtree.server import receiver  # noqa: E402
from ddtree.server.engine_core import EngineCore  # noqa: E402
from ddtree.server.jobs import Chunk, Failed, Handle, Usage  # noqa: E402
from ddtree.server.outputs import TextOutputs  # noqa: E402
from ddtree.server.wire import to_wire  # noqa: E402


class _Alive:
    """The core process's stand-in: alive until stop() kills it."""

    exitcode = None
    alive = True

    def is_alive(self) -> bool:
        return self.alive

    def join(self, timeout=None) -> None:
        pass

    def kill(self) -> None:
        self.alive = False


def _stand_in(loop, requests: list[str]) -> tuple[EngineCore, zmq.Socket, dict[str, Handle]]:
    core = EngineCore(None, None)
    core._dir = tempfile.mkdtemp(prefix="ddtree-receiver-test-")
    core._context = zmq.Context()
    core._to_core = core._context.socket(zmq.PUSH)  # connected to nothing: sends are dropped
    core._from_core = core._context.socket(zmq.PULL)
    core._from_core.bind(f"ipc://{core._dir}/from_core")
    core._process = _Alive()
    core._outputs = TextOutputs(None)
    feed = zmq.Context.instance().socket(zmq.PUSH)  # not the core's: its stop() ends its context
    feed.connect(f"ipc://{core._dir}/from_core")
    handles = {}
    for rid in requests:
        handles[rid] = core._handles[rid] = Handle(rid, loop)
        core._outputs.open(rid, ())
    return core, feed, handles


def _turn(step: int, requests: list[str], last: bool = False) -> tuple:
    usage = Usage(3, step + 1, "ar", None, step, 1.0)
    events = [(rid, Chunk("", 1, usage, "length" if last else None, (step,))) for rid in requests]
    return ("turn", to_wire(events), [("generated_tokens", "inc", len(requests))], {"running": len(requests)})


async def _drain(handle: Handle) -> list:
    out = []
    while True:
        event = await asyncio.wait_for(handle.next(), 10)
        out.append(event)
        if isinstance(event, Failed) or event.finish_reason is not None:
            return out


def test_a_backlog_longer_than_one_wake_up_reaches_every_request_in_order():
    turns = 3 * receiver.MAX_TURNS + 5
    requests = ["a", "b", "c"]

    async def run():
        core, feed, handles = _stand_in(asyncio.get_running_loop(), requests)
        for step in range(turns):  # all queued before the receiver starts: a backlog
            feed.send_pyobj(_turn(step, requests, last=step == turns - 1))
        core.start()
        got = {rid: await _drain(handle) for rid, handle in handles.items()}
        await asyncio.to_thread(core.stop)
        feed.close(linger=0)
        return core, got

    core, got = asyncio.run(run())
    for rid in requests:
        tokens = [t for event in got[rid] for t in event.token_ids]
        assert tokens == list(range(turns)), rid
        assert got[rid][-1].finish_reason == "length" and got[rid][-1].usage.completion_tokens == turns
        assert len(got[rid]) < turns  # joined: fewer events than turns
    assert core.snapshot["running"] == 3 and core._receiver_ended.is_set()


def test_chunks_before_a_died_message_arrive_before_the_failure():
    async def run():
        core, feed, handles = _stand_in(asyncio.get_running_loop(), ["a"])
        died = asyncio.Event()
        core.on_death = died.set
        feed.send_pyobj(_turn(0, ["a"]))
        feed.send_pyobj(_turn(1, ["a"]))
        feed.send_pyobj(("died", "a tensor-parallel rank is gone"))
        core.start()
        events = await _drain(handles["a"])
        await asyncio.wait_for(died.wait(), 10)
        await asyncio.to_thread(core.stop)
        feed.close(linger=0)
        return core, events

    core, events = asyncio.run(run())
    assert [t for e in events[:-1] for t in e.token_ids] == [0, 1]
    assert isinstance(events[-1], Failed) and events[-1].error.code == "engine_dead"
    assert "rank is gone" in core.died


def test_stop_on_the_receivers_own_loop_stops_watching_the_socket():
    async def run():
        loop = asyncio.get_running_loop()
        core, feed, _ = _stand_in(loop, [])
        core.start()
        await asyncio.sleep(0.05)  # the task is waiting on the socket
        fd = core._from_core.getsockopt(zmq.FD)
        core.stop()  # on the loop itself: it cannot wait for the task
        watched = fd in loop._selector.get_map()
        await asyncio.sleep(0)
        feed.close(linger=0)
        return watched, core._receiver_task

    watched, task = asyncio.run(run())
    assert not watched and task.done()
