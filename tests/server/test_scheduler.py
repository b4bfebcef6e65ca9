"""The scheduler on its own, with a stand-in engine: races between the HTTP side and its thread."""

from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace

from ddtree.server.jobs import Failed, Job
from ddtree.server.metrics import Metrics
from ddtree.server.scheduler import Scheduler


class _IdleEngine:
    """What the scheduler reads from an engine that never gets a request. has_unfinished holds
    the scheduler's loop until `stopping` is set, so a job put before stop() is first seen after
    it (never accepted by a loop that has not noticed the stop yet: that race made the test flaky)."""

    blocks = SimpleNamespace(num_free=4, num_pages=4, num_promised=0)
    num_running = 0
    graphs = None  # an engine without CUDA graphs (the CPU)
    stopping = threading.Event()

    def has_unfinished(self) -> bool:
        self.stopping.wait(5)
        return False


class _StopBeforePut:
    """The inbox, with stop() started (in another thread) just before a submission is put: the
    interleaving where submit has passed its check of _stop and the thread drains and exits."""

    def __init__(self, scheduler):
        self.scheduler, self.inner, self.stopper = scheduler, scheduler._inbox, None

    def put(self, item) -> None:
        if item is not None and item[0] == "submit" and self.stopper is None:
            self.stopper = threading.Thread(target=self.scheduler.stop)
            self.stopper.start()
            self.scheduler._thread.join(1.0)  # the old submit: the thread is gone before the put
        self.inner.put(item)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_a_submission_racing_stop_gets_an_event():
    engine = _IdleEngine()
    scheduler = Scheduler(engine, Metrics(), idle_wait_s=0.01)
    engine.stopping = scheduler._stop
    scheduler.start()
    inbox = scheduler._inbox = _StopBeforePut(scheduler)
    job = Job("cmpl-race", "x", None, 4, {"temperature": 0.0}, "ar", 1)

    async def submit_and_wait():
        handle = scheduler.submit(job, asyncio.get_running_loop())
        return await asyncio.wait_for(handle.next(), 5)

    try:
        event = asyncio.run(submit_and_wait())
    finally:
        if inbox.stopper is not None:
            inbox.stopper.join(5)
    assert isinstance(event, Failed) and event.error.status == 503
    assert scheduler.snapshot["queued"] == 0


def test_the_scheduler_thread_takes_the_process_thread_count(monkeypatch):
    """torch's intra-op thread count is set per thread: the scheduler thread sets the process's
    count on itself (unset, a CPU round there ran on every core, beside the event loop)."""
    import torch

    from ddtree.server import scheduler as module

    calls = []
    monkeypatch.setattr(module.torch, "set_num_threads", lambda n: calls.append((threading.current_thread().name, n)))
    engine = _IdleEngine()
    scheduler = Scheduler(engine, Metrics(), idle_wait_s=0.01)
    engine.stopping = scheduler._stop
    scheduler.start()
    scheduler.stop()
    assert calls == [("ddtree-scheduler", torch.get_num_threads())]


def test_a_lost_rank_fails_every_request_and_ends_the_loop(pairs, monkeypatch):
    """engine.step raising RankLost (a tensor-parallel rank gone): the request fails with 503
    engine_dead naming it, the loop ends on its own and calls on_fatal (one process ends the
    server there), and later submissions are refused."""
    import pytest

    from ddtree import Engine
    from ddtree.parallel.relay import RankLost

    from .conftest import ENGINE_ARGS

    engine = Engine.from_pretrained(pairs["target_chat"], pairs["drafter"], max_batch=1, **ENGINE_ARGS)

    def lost():
        raise RankLost("a tensor-parallel rank is gone (its process died or stopped answering)")

    monkeypatch.setattr(engine, "step", lost)
    scheduler = Scheduler(engine, Metrics(), idle_wait_s=0.01)
    ended = threading.Event()
    scheduler.on_fatal = ended.set
    scheduler.start()

    async def submit_and_wait():
        handle = scheduler.submit(Job("cmpl-lost", "x", None, 4, {"temperature": 0.0}, "ar", 1),
                                  asyncio.get_running_loop())
        events = [await asyncio.wait_for(handle.next(), 10)]
        while not isinstance(events[-1], Failed):
            events.append(await asyncio.wait_for(handle.next(), 10))
        return events[-1]

    try:
        event = asyncio.run(submit_and_wait())
        assert isinstance(event, Failed) and (event.error.status, event.error.code) == (503, "engine_dead")
        assert "a tensor-parallel rank is gone" in event.error.message
        assert ended.wait(5) and "rank is gone" in scheduler.fatal and not scheduler.alive
        with pytest.raises(RuntimeError):
            asyncio.run(submit_and_wait())
    finally:
        scheduler.stop(5)


def test_an_engine_core_scheduler_sends_accepted_before_the_step_runs(pairs):
    """With on_turn (an engine core), a drain that accepted requests is followed by on_turn before
    the step, so their Accepted reach the HTTP process while the prefill runs (it starts each
    response meanwhile); the chunks follow in the turns after."""
    from ddtree import Engine
    from ddtree.server.core_process import _Outbox, _RecordedMetrics
    from ddtree.server.jobs import Accepted

    from .conftest import ENGINE_ARGS

    engine = Engine.from_pretrained(pairs["target_chat"], pairs["drafter"], max_batch=2, **ENGINE_ARGS)
    outbox, sent, seen_at_step = _Outbox(), [], []

    def flush(_snapshot):
        sent.append(outbox.take()[0])

    step = engine.step

    def recorded_step():
        seen_at_step.append([event for turn in sent for event in turn])
        return step()

    engine.step = recorded_step
    scheduler = Scheduler(engine, _RecordedMetrics(outbox), on_turn=flush, handle_of=outbox.handle, idle_wait_s=0.01,
                          detokenize=False)
    scheduler.start()
    try:
        for i in range(2):
            scheduler.submit(Job(f"cmpl-{i}", [5, 6, 7], None, 3, {"temperature": 0.0}, "ar", 1))
        deadline = time.monotonic() + 20
        while sum(item[2] for turn in sent for item in turn if len(item) == 6) < 2 * 3 and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        scheduler.stop(5)
    first = seen_at_step[0]  # what had gone out when the first step began
    assert first and all(len(item) == 2 and type(item[1]) is Accepted for item in first), first
    assert {item[0] for item in first} <= {"cmpl-0", "cmpl-1"}
    events = [item for turn in sent for item in turn]
    for rid in ("cmpl-0", "cmpl-1"):  # each request's Accepted before any of its chunks, its 3 tokens all sent
        mine = [item for item in events if item[0] == rid]
        assert type(mine[0][1]) is Accepted and sum(item[2] for item in mine[1:]) == 3, mine
