"""The HTTP process's receiver of the engine core's turns (engine_core.EngineCore's half that reads):
a task of the app's event loop (or a thread, outside one) that routes each turn's events to the
requests' handles, their chunks decoded into text on the way (outputs.py), applies the core's
metric updates and notices a core that died.
"""

from __future__ import annotations

import asyncio
import logging
import time

import zmq

from .core_process import POLL_MS
from .errors import APIError, internal_error
from .jobs import Chunk, Failed, push_all
from .wire import joined_from_wire

log = logging.getLogger("ddtree.server")

MAX_TURNS = 64  # the core's turns one wake-up of the receiver routes at most


class TurnReceiver:
    """EngineCore's receiving half; it reads and changes the state EngineCore sets up (_from_core,
    _handles, _waiting, _outputs, _lock, _stopping, _receiver_ended, _looked, _scrapes, api_servers,
    snapshot, metrics, died, on_death) and sends through its _send; _core_gone says whether the core is still there."""

    def _receive(self) -> None:
        while not self._stopping.is_set():
            try:
                if not self._receive_one(POLL_MS):
                    return
            except Exception:  # never let the thread die silently: the requests would wait forever
                if self._stopping.is_set():
                    return
                log.exception("engine-core receiver: unexpected error; going on")

    async def _receive_in_loop(self) -> None:
        # ZeroMQ's descriptor signals that the socket's events may have changed (read them to rearm):
        # wait on it only when no message is ready, and at most POLL_MS (is the core still alive?)
        # (a future and a timer, not wait_for: a turn reaches its streams one loop iteration
        # after the descriptor wakes the loop)
        loop, fd = asyncio.get_running_loop(), self._from_core.getsockopt(zmq.FD)
        waiter = None

        def wake() -> None:
            if waiter is not None and not waiter.done():
                waiter.set_result(None)

        loop.add_reader(fd, wake)
        try:
            while not self._stopping.is_set():
                try:
                    if not self._from_core.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                        waiter = loop.create_future()
                        timer = loop.call_later(POLL_MS / 1000, wake)
                        try:
                            await waiter
                        finally:
                            timer.cancel()
                            waiter = None
                    if not self._receive_one(0):
                        return
                    # the streams write what was routed before the next read: turns that came
                    # meanwhile are then routed at once, each request's chunks joined (a busy
                    # process sends fewer, larger events instead of falling behind)
                    await asyncio.sleep(0)
                except Exception:  # never let the task end silently: the requests would wait forever
                    if self._stopping.is_set():
                        return
                    log.exception("engine-core receiver: unexpected error; going on")
        finally:
            self._stop_watching(loop, fd)
            self._receiver_ended.set()

    def _stop_watching(self, loop, fd: int) -> None:
        """The loop no longer watches the socket (idempotent): before the socket closes."""
        if not loop.is_closed():
            loop.remove_reader(fd)

    def _receive_one(self, wait_ms: int) -> bool:
        """Route the turns the core has sent (up to MAX_TURNS at once: a receiver that fell behind
        joins each request's chunks across them), or notice that the core died; False: nothing
        more will come. The events are routed before the metric updates are applied, so that a
        failing update loses no event."""
        if self._from_core.poll(wait_ms):
            events, updates, snapshot, died = [], [], None, None
            for _ in range(MAX_TURNS):
                try:
                    message = self._from_core.recv_pyobj(flags=zmq.NOBLOCK)
                except zmq.Again:
                    break
                if message[0] == "died":  # the core's engine cannot go on (a tensor-parallel rank lost)
                    died = message[1]
                    break
                if message[0] == "scraped":
                    self._answer_scrape(*message[1:])
                    continue
                _, turn_events, turn_updates, snapshot = message
                events.extend(turn_events)
                updates.extend(turn_updates)
            self._route(joined_from_wire(events))
            self._apply(updates, snapshot)
            if died is not None:
                return self._died(died)
            if time.monotonic() - self._looked < POLL_MS / 1000:  # under load too: the core's turns need not stop
                return True                                         # when the process that launched it has gone
        self._looked = time.monotonic()
        if not self._stopping.is_set() and (gone := self._core_gone()) is not None:
            return self._died(gone)
        return True

    def _apply(self, updates: list, snapshot: dict | None) -> None:
        """The core's metric updates on this process's registry, and its latest snapshot."""
        if snapshot is not None:  # with one API process its own count of waiting requests is exact
            self.snapshot = snapshot if self.api_servers > 1 else {**snapshot, "queued": len(self._waiting)}
        if self.metrics is None:
            return
        for name, method, value in updates:
            try:
                getattr(getattr(self.metrics, name), method)(value)
            except Exception:  # a metric is not worth a request: log it and go on
                log.exception("engine-core receiver: metric update %s.%s failed", name, method)
        if snapshot is not None:
            self.metrics.publish(self.snapshot)

    def _answer_scrape(self, token: int, text: bytes) -> None:
        future = self._scrapes.get(token)
        if future is not None:  # else it timed out
            future.get_loop().call_soon_threadsafe(lambda: future.done() or future.set_result(text))

    def _died(self, why: str) -> bool:
        """The core can serve no more: fail what it held, say why, end the server (on_death)."""
        self.died = why
        log.error("%s; failing the requests it held", why)
        self._fail_all(APIError(503, f"{why}; this server is shutting down", code="engine_dead"))
        self.snapshot = {**self.snapshot, "running": 0, "live": 0}
        if self.on_death is not None:
            self.on_death()
        return False

    def _route(self, events) -> None:
        stopped, delivered = [], []
        with self._lock:
            for request_id, event in events:
                handle = self._handles.get(request_id)
                if handle is None:  # aborted here already, or ended at a stop string
                    continue
                if isinstance(event, Chunk):
                    try:
                        event, stop = self._outputs.process(request_id, event)
                    except Exception:  # this request fails; the others' events still go out
                        log.exception("request %s: failed while decoding its tokens", request_id)
                        self._outputs.close(request_id)
                        event, stop = Failed(internal_error(request_id)), True
                    if stop:
                        stopped.append(request_id)
                elif isinstance(event, Failed):
                    self._outputs.close(request_id)
                if isinstance(event, (Chunk, Failed)):
                    self._waiting.discard(request_id)
                    if isinstance(event, Failed) or event.finish_reason is not None:
                        del self._handles[request_id]
                delivered.append((handle, event))
        push_all(delivered)  # one wake-up of the HTTP loop for the turn's events
        for request_id in stopped:  # the core commits on until it reads this: its chunks are dropped
            self._send(("abort", request_id))

    def _fail_all(self, error: APIError) -> None:
        with self._lock:
            handles, self._handles = self._handles, {}
            self._waiting.clear()
            self._outputs.clear()
        for handle in handles.values():
            handle.push(Failed(error))
