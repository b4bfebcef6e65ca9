"""The engine in a process of its own, as vLLM V1's engine core: the child process (core_process.py)
owns the Engine, the scheduler loop (scheduler.py) and the rounds; the HTTP process keeps the app,
the requests' handles, their text (outputs.py), the streams' formatting and the Prometheus
metrics, so neither waits for the other's interpreter. This module is the HTTP process's end (its
receiving half: receiver.py).

Transport: two ZeroMQ PUSH / PULL sockets (pyzmq) on ipc:// paths, one pickled Python object per
message. To the core: ("submit", job), ("abort", id), ("fail_all",), ("stop",). From the core:
("ready", facts, snapshot, tokenizer, core decodes) once the engine is loaded, or ("failed", type, line); then per scheduler turn at most one
("turn", events, metric updates, snapshot), events being (request id, Accepted | Chunk | Failed); a receiver
that fell behind routes the turns waiting for it at once, each request's chunks joined (wire.joined_from_wire).
The core's sends are queued by ZeroMQ: it never waits for the HTTP side or a client.

Lifetime: the HTTP process starts the core, stops it with ("stop",) (it drains on SIGTERM first, as
before) and kills it if it does not end; the core ignores SIGINT / SIGTERM (the HTTP process decides)
and ends by itself when its parent is gone, so no core outlives its server. A core that dies fails
every waiting request with a 503 and `died` says why.

Several API-server processes (api_servers > 1; api_servers.py starts them): the process that
launched the core is API server 0; the others attach to it (`EngineCore.attached(...).connect()`),
each with its own pair of sockets; every message to the core names its sender's index. An attached
process learns that the core died from the launching process (a "died" message on its socket) and
ends when that process has.
"""

from __future__ import annotations

import asyncio
import dataclasses
import multiprocessing
import shutil
import tempfile
import threading
import time

import zmq

from .core_process import POLL_MS, core_main
from .errors import APIError
from .jobs import Handle
from .outputs import TextOutputs
from .prompts import encode_text
from .receiver import TurnReceiver
from .scheduler import QueueFull


class EngineCore(TurnReceiver):
    """The HTTP process's end: the Scheduler's interface (submit, abort, drains, snapshot) over an
    engine-core process. build: a picklable callable returning the Engine (run in the child);
    facts_of: a picklable callable of the engine returning the dict the app needs (its `facts`)."""

    def __init__(self, build, facts_of, *, max_queue: int = 256, limits=None, start_timeout_s: float | None = None,
                 api_servers: int = 1):
        """api_servers: the HTTP processes that will serve over this core (this one and
        api_servers - 1 attached ones); max_queue: this process's share of the waiting requests."""
        self.build, self.facts_of, self.max_queue, self.limits = build, facts_of, max_queue, limits
        self.start_timeout_s = start_timeout_s
        self.api_servers, self.index = api_servers, 0
        self._dir: str | None = None
        self.metrics = None  # the app's Metrics (create_app sets it)
        self.facts: dict = {}
        self.snapshot: dict = {}
        self.died: str | None = None  # why the core ended while serving
        self.on_death = None  # called once (from the receiver: the app's loop or a thread) when the core dies while serving
        self._handles: dict[str, Handle] = {}
        self._waiting: set[str] = set()  # submitted, neither started nor failed: the queue's length
        self._lock = threading.Lock()  # the PUSH socket and the two collections
        self._stop_lock = threading.Lock()  # stop() callers, one at a time
        self._draining = threading.Event()
        self._stopping = threading.Event()
        self._receiver: threading.Thread | None = None
        self._receiver_task: asyncio.Task | None = None  # or the receiver runs in the app's loop
        self._receiver_ended = threading.Event()
        self._looked = 0.0  # when the receiver last checked that the core is there
        self._scrapes: dict[int, asyncio.Future] = {}  # several API servers: scrapes the core has to answer
        self._process = None
        self._outputs = TextOutputs(None)  # the requests' text, with the core's tokenizer once launched
        self._core_decodes = False

    # -- start and stop -------------------------------------------------------------------------------

    @classmethod
    def attached(cls, directory: str, index: int, api_servers: int, *, max_queue: int = 256, limits=None,
                 start_timeout_s: float | None = None) -> "EngineCore":
        """API server `index` (> 0) of a core that another process launches (its `directory`)."""
        core = cls(None, None, max_queue=max_queue, limits=limits, start_timeout_s=start_timeout_s,
                   api_servers=api_servers)
        core.index, core._dir = index, directory
        return core

    @staticmethod
    def address(directory: str, direction: str, index: int) -> str:
        """The ipc:// address of API server `index`'s socket to_core / from_core."""
        return f"ipc://{directory}/{direction}.{index}"

    def _bind(self) -> None:
        self._context = zmq.Context()
        self._to_core, self._from_core = self._context.socket(zmq.PUSH), self._context.socket(zmq.PULL)
        self._to_core.setsockopt(zmq.SNDHWM, 0)
        self._to_core.bind(self.address(self._dir, "to_core", self.index))
        self._from_core.bind(self.address(self._dir, "from_core", self.index))

    def launch(self) -> dict:
        """Start the core process and wait until its engine is loaded; returns its facts. Raises
        RuntimeError with the core's one-line reason if it fails or dies first."""
        self._dir = tempfile.mkdtemp(prefix="ddtree-core-")
        self._bind()
        scheduler_args = dict(max_queue=1 << 30, limits=self.limits, detokenize=False)  # the HTTP side: max_queue, text
        addresses = [[self.address(self._dir, direction, i) for i in range(self.api_servers)]
                     for direction in ("to_core", "from_core")]
        self._process = multiprocessing.get_context("spawn").Process(
            target=core_main, args=(*addresses, self.build, self.facts_of, scheduler_args), name="ddtree-engine-core")
        self._process.start()
        return self._await_ready("the engine process ended while loading")

    def connect(self) -> dict:
        """An attached API server: bind its sockets and wait for the core's facts (as launch)."""
        self._bind()
        return self._await_ready("the server's main process ended while the engine loaded")

    def _await_ready(self, ended: str) -> dict:
        deadline = None if self.start_timeout_s is None else time.monotonic() + self.start_timeout_s
        try:
            while not self._from_core.poll(POLL_MS):
                if self._core_gone() is not None:
                    code = self._process.exitcode if self._process is not None else None
                    raise RuntimeError(ended + ("" if code is None else f" (exit code {code})"))
                if deadline is not None and time.monotonic() > deadline:
                    raise RuntimeError(f"the engine process did not load within {self.start_timeout_s:g} s")
        except BaseException:  # Ctrl-C while it loads included: no core outlives the launch
            self._close(kill=True)
            raise
        try:
            message = self._from_core.recv_pyobj()
        except BaseException:
            self._close(kill=True)
            raise
        if message[0] != "ready":
            self._close(kill=True)
            from ..arguments import UsageError  # the user's directories or flags: exit 2, as in one process

            raise (UsageError if message[1] == "UsageError" else RuntimeError)(message[2])
        self.facts, self.snapshot = message[1], {**message[2], "queued": 0}
        if self.api_servers > 1:
            self.facts = {**self.facts, "api_servers": self.api_servers, "api_server": self.index}
        self._outputs = TextOutputs(message[3])
        self._core_decodes = message[4]  # its tokenizer did not pickle: the core keeps the text
        return self.facts

    def start(self) -> None:
        """Start routing the core's events: called in a running event loop (the app's lifespan), as
        a task of that loop, so one thread does all of the HTTP side's work (a receiver thread beside
        the loop passed the interpreter lock back and forth every turn); else from a thread."""
        if self.api_servers > 1 and self.metrics is not None:  # every process reports every process's requests
            self.metrics.forward = lambda endpoint, status: self._send(("count", endpoint, status))
        if self.metrics is not None:  # the ready snapshot's gauges from the first scrape, not the first turn
            self.metrics.publish(self.snapshot)
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            self._receiver = threading.Thread(target=self._receive, name="ddtree-core-receiver", daemon=True)
            self._receiver.start()
            return
        self._receiver_task = loop.create_task(self._receive_in_loop())

    def stop(self, timeout_s: float = 30.0) -> None:
        """Stop the core (its running requests fail with 503) and wait for it; kill it past timeout_s.
        An attached API server detaches instead (its requests are dropped; the core goes on).
        Idempotent, and one caller at a time (the app's lifespan and its server's owner may both call
        it: two zmq Context.term calls at once hang one of them)."""
        with self._stop_lock:
            if self._to_core.closed:
                return
            self._stopping.set()
            self._send(("stop",) if self._process is not None else ("detach", self.index))  # attached: the core goes on
            if self._process is not None:
                self._process.join(timeout_s)
            if self._receiver is not None:
                self._receiver.join(5)
            elif self._receiver_task is not None and not self._on_receiver_loop():
                self._receiver_ended.wait(5)  # sockets are closed below: not while the task polls
            elif self._receiver_task is not None:  # called on the receiver's own loop: it cannot wait
                self._stop_watching(self._receiver_task.get_loop(), self._from_core.getsockopt(zmq.FD))
                self._receiver_task.cancel()
            self._fail_all(APIError(503, "the server is shutting down", code="shutting_down"))
            self._close(kill=True)

    def _on_receiver_loop(self) -> bool:
        try:
            return asyncio.get_running_loop() is self._receiver_task.get_loop()
        except RuntimeError:
            return False

    def _close(self, kill: bool = False) -> None:
        if kill and self._process is not None and self._process.is_alive():
            self._process.kill()
            self._process.join(5)
        with self._lock:  # an attached server's last messages (its counts, its detach) still go out
            self._to_core.close(linger=0 if self._process is not None else 1000)
            self._from_core.close(linger=0)
        self._context.term()
        if self._process is not None:  # the launching process's folder
            shutil.rmtree(self._dir, ignore_errors=True)

    # -- the scheduler's interface ---------------------------------------------------------------------

    @property
    def alive(self) -> bool:
        return (not self._stopping.is_set() and self.died is None and hasattr(self, "_from_core")
                and self._core_gone() is None)

    def _core_gone(self) -> str | None:
        """Why this process can no longer reach the core, or None: the core process ended (the
        launching process), or the process that launched it has (an attached one)."""
        if self._process is not None:
            return None if self._process.is_alive() else \
                f"the engine process stopped unexpectedly (exit code {self._process.exitcode})"
        parent = multiprocessing.parent_process()
        if self.index > 0 and parent is not None and not parent.is_alive():
            return "the server's main process ended"
        return None

    @property
    def draining(self) -> bool:
        return self._draining.is_set()

    @property
    def idle(self) -> bool:
        """Nothing of this process's is waiting or running (of every process's, for the launching one:
        it stops the core after)."""
        if self._process is None:
            return not self._handles
        return not self._waiting and self.snapshot.get("running", 0) == 0 and self.snapshot.get("live", 0) == 0

    def begin_drain(self) -> None:
        self._draining.set()

    def end_drain(self) -> None:
        self._send(("fail_all", self.index))

    async def scrape(self, timeout_s: float = 5.0) -> bytes:
        """The Prometheus text of the core's registry (several API servers: the one source of the
        totals). RuntimeError when the core is gone or does not answer within timeout_s."""
        if self.died is not None or self._stopping.is_set():
            raise RuntimeError(f"the engine is not running ({self.died or 'shutting down'})")
        future = asyncio.get_running_loop().create_future()
        token = id(future)
        self._scrapes[token] = future
        try:
            self._send(("scrape", self.index, token))
            return await asyncio.wait_for(future, timeout_s)
        except asyncio.TimeoutError:
            raise RuntimeError(f"the engine process did not answer within {timeout_s:g} s") from None
        finally:
            self._scrapes.pop(token, None)

    def detach(self, index: int) -> None:
        """API server `index` is gone: the core drops its requests."""
        self._send(("detach", index))

    @property
    def directory(self) -> str:
        """The folder of the API servers' sockets (api_servers.py attaches the others here)."""
        return self._dir

    def submit(self, job, loop) -> Handle:
        """As Scheduler.submit: raises QueueFull, or RuntimeError when shutting down or the core is
        gone; an APIError (400) for text its tokenizer cannot encode. Text and chat messages are
        encoded here (the core checks the ids), under the lock the decoding of outputs holds."""
        handle = Handle(job.request_id, loop)
        with self._lock:
            if not self._core_decodes and (job.messages is not None or isinstance(job.prompt, str)):
                ids = encode_text(self._outputs.tokenizer, job)
                job = dataclasses.replace(job, prompt=ids, messages=None, encoded_from=job.prompt_param)
            if self.died is not None:
                raise RuntimeError(f"the engine is not running ({self.died})")
            if self._stopping.is_set() or self._draining.is_set():
                raise RuntimeError("the server is shutting down")
            if len(self._waiting) >= self.max_queue:
                share = f", this API server's share of {self.api_servers}" if self.api_servers > 1 else ""
                raise QueueFull(f"{len(self._waiting)} requests are waiting (max_queue={self.max_queue}{share})")
            try:
                self._to_core.send_pyobj(("submit", job, self.index), flags=zmq.NOBLOCK)
            except zmq.Again:  # no core connected: it has ended (the receiver says why in a moment)
                raise RuntimeError("the engine is not running") from None
            self._handles[job.request_id] = handle
            self._waiting.add(job.request_id)
            self._outputs.open(job.request_id, tuple(job.sampling.get("stop") or ()))
        return handle

    def abort(self, request_id: str) -> None:
        with self._lock:
            self._handles.pop(request_id, None)
            self._waiting.discard(request_id)
            self._outputs.close(request_id)
        self._send(("abort", request_id))

    def _send(self, message) -> None:
        """Send without waiting: a core that has ended takes nothing (and needs nothing)."""
        with self._lock:
            if not self._to_core.closed:
                try:
                    self._to_core.send_pyobj(message, flags=zmq.NOBLOCK)
                except zmq.Again:
                    pass

    @property
    def pid(self) -> int | None:
        """The core process's pid."""
        return None if self._process is None else self._process.pid
