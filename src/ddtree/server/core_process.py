"""The engine-core process's side (engine_core.py is the HTTP process's): it builds the Engine,
runs the scheduler loop (scheduler.py) with handles and metrics that record into one batch per
turn, and sends each turn's batch to the HTTP processes without waiting for them.

Several API-server processes (`ddtree serve --api-server-count N`, as vLLM's): each binds its own
pair of sockets and the core connects to all of them; a request's events go to the process that
submitted it, the snapshot to every process (frontends.py); the core keeps the one metrics registry
and answers each process's scrape with its text.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import pickle
import signal
import threading
import time

import zmq

from ..engine.heap import frozen_heap
from .errors import APIError
from .frontends import Frontends
from .jobs import Failed
from .metrics import Metrics
from .scheduler import QueueFull, Scheduler

log = logging.getLogger("ddtree.server")
POLL_MS = 100  # how often a waiting side looks up from its socket (the other process may be gone)


class _Outbox:
    """The core's side: handles and metrics that record into one batch, sent once per turn."""

    def __init__(self):
        self.events, self.updates = [], []
        self.counts: dict[str, float] = {}  # counters' increments, summed over the turn (one update each)
        self.lock = threading.Lock()

    def handle(self, request_id: str) -> "_RemoteHandle":
        return _RemoteHandle(request_id, self)

    def add(self, kind: str, item) -> None:
        with self.lock:
            (self.events if kind == "event" else self.updates).append(item)

    def count(self, name: str, value: float) -> None:
        with self.lock:
            self.counts[name] = self.counts.get(name, 0) + value

    def take(self):
        with self.lock:
            events, updates, counts = self.events, self.updates, self.counts
            self.events, self.updates, self.counts = [], [], {}
        return events, [(name, "inc", value) for name, value in counts.items()] + updates


class _RemoteHandle:
    def __init__(self, request_id: str, outbox: _Outbox):
        self.request_id, self.outbox = request_id, outbox

    def push(self, event) -> None:
        self.outbox.add("event", (self.request_id, event))

    def push_chunk(self, text: str, num_tokens: int, usage: tuple, finish_reason, token_ids: tuple) -> None:
        """A chunk as the socket carries it (wire.py), built once: a turn's events are the most of its work."""
        self.outbox.events.append((self.request_id, text, num_tokens, usage, finish_reason, token_ids))


class _RecordedMetric:
    def __init__(self, name: str, outbox: _Outbox):
        self.name, self.outbox = name, outbox

    def inc(self, value: float = 1) -> None:
        self.outbox.count(self.name, value)

    def observe(self, value: float) -> None:
        self.outbox.add("update", (self.name, "observe", value))

    def observe_counts(self, counts: dict) -> None:
        self.outbox.add("update", (self.name, "observe_counts", counts))


class _RecordedMetrics:
    """What Scheduler updates on server.metrics.Metrics (any counter or histogram by its name),
    recorded for the HTTP process's registry."""

    def __init__(self, outbox: _Outbox):
        self.outbox = outbox

    def __getattr__(self, name: str) -> _RecordedMetric:
        metric = _RecordedMetric(name, self.outbox)
        setattr(self, name, metric)  # found as an attribute from now on
        return metric

    def publish(self, snapshot: dict) -> None:  # the snapshot travels with each turn instead
        pass


def _ignore(_signum, _frame) -> None:
    """The core's SIGINT / SIGTERM: the HTTP process decides when it ends. A handler, not SIG_IGN,
    so that the processes it starts (tensor-parallel ranks) get the default handling back."""


def _exit_with_parent(done: threading.Event) -> None:
    """While the engine loads (the serving loop checks for itself after): end when the parent has."""
    parent = multiprocessing.parent_process()
    while parent is not None and not done.wait(0.5):
        if not parent.is_alive():
            os._exit(1)


def tokenizer_to_send(tokenizer) -> tuple[object, bool]:
    """(the tokenizer for the HTTP process, whether this process keeps the text instead): the HTTP
    process encodes and decodes with a copy of the engine's tokenizer; one that does not pickle (a
    remote-code class the other process may not import) leaves the text here, as in one process."""
    if tokenizer is None:
        return None, False
    try:
        pickle.loads(pickle.dumps(tokenizer))
    except Exception as err:
        log.warning("the tokenizer cannot be sent to the HTTP process (%s: %s): the engine process keeps "
                    "the text (decoding, stop strings, prompt encoding)", type(err).__name__, err)
        return None, True
    return tokenizer, False


def core_main(to_core: list[str], from_core: list[str], build, facts_of, scheduler_args: dict) -> None:
    """The engine-core process: build the engine (`build()`), then serve the messages of the HTTP
    processes (one pair of addresses each, in their order; see the module's docstring)."""
    signal.signal(signal.SIGINT, _ignore)
    signal.signal(signal.SIGTERM, _ignore)
    loaded = threading.Event()
    threading.Thread(target=_exit_with_parent, args=(loaded,), name="ddtree-parent-watch", daemon=True).start()
    context = zmq.Context()
    inbox = context.socket(zmq.PULL)
    for address in to_core:
        inbox.connect(address)
    frontends = Frontends(context, from_core)
    try:
        engine = build()
        facts = facts_of(engine)
        loaded.set()
    except BaseException as err:  # the HTTP process raises it again as the server's one-line error
        frontends.send_all(("failed", type(err).__name__, str(err)))
        frontends.close()
        raise SystemExit(1)
    outbox = _Outbox()

    def flush(snapshot: dict) -> None:  # the scheduler thread, after every turn
        frontends.send_turn(*outbox.take(), snapshot)

    tokenizer, decodes_here = tokenizer_to_send(engine.tokenizer)
    # several API servers: the one registry is here (each scrape asks for it; replicas in each process
    # would lag by different amounts, and a counter read from two of them could go back)
    registry = Metrics() if len(from_core) > 1 else None
    scheduler = Scheduler(engine, registry or _RecordedMetrics(outbox), on_turn=flush, handle_of=outbox.handle,
                          **{**scheduler_args, "detokenize": decodes_here})
    frontends.send_all(("ready", facts, scheduler.snapshot, tokenizer, decodes_here))
    scheduler.start()
    parent, looked = multiprocessing.parent_process(), time.monotonic()
    try:
        with frozen_heap():  # what start-up built stays out of the collections serving triggers
            while scheduler.alive:
                ready = inbox.poll(POLL_MS)
                if time.monotonic() - looked >= POLL_MS / 1000:  # busy or not (other API servers keep sending)
                    looked = time.monotonic()
                    if parent is not None and not parent.is_alive():  # the server is gone: so is its core
                        break
                if not ready:
                    continue
                message = inbox.recv_pyobj()
                if message[0] == "stop":
                    break
                _serve_message(message, scheduler, frontends, outbox, registry)
    finally:
        scheduler.stop()
        frontends.send_turn(*outbox.take(), scheduler.snapshot, force=True)  # what the last turns left pending
        if scheduler.fatal is not None:  # the HTTP side ends the server with this line
            frontends.send_all(("died", scheduler.fatal))
        if hasattr(engine, "close"):  # a tensor-parallel engine's ranks
            engine.close()
        frontends.close()
        inbox.close(linger=0)
        context.term()
    if scheduler.fatal is not None:
        raise SystemExit(1)


def _serve_message(message: tuple, scheduler: Scheduler, frontends: Frontends, outbox: _Outbox,
                   registry: Metrics | None) -> None:
    """One message of an HTTP process: ("submit", job, its index), ("abort", id), ("fail_all", index:
    that process's requests), ("detach", index: the process ends; drop its requests), ("count",
    endpoint, status: a finished request) or ("scrape", index, token: the metrics' text, answered
    ("scraped", token, text)); the last two with several API servers only (the registry is here)."""
    kind = message[0]
    if kind == "submit":
        job = message[1]
        if message[2] in frontends.detached:  # sent before its process ended, read after: nobody waits for it
            return
        frontends.of[job.request_id] = message[2]
        try:
            scheduler.submit(job)
        except (QueueFull, RuntimeError) as err:  # the HTTP side refuses these first: a race at most
            outbox.handle(job.request_id).push(Failed(APIError(503, str(err), code="shutting_down")))
    elif kind == "abort":
        scheduler.abort(message[1])
        frontends.of.pop(message[1], None)
    elif kind == "fail_all":
        scheduler.end_drain(frontends.requests_of(message[1]))
    elif kind == "detach":
        frontends.detached.add(message[1])
        for rid in frontends.requests_of(message[1]):
            scheduler.abort(rid)
            frontends.of.pop(rid, None)
    elif kind == "count" and registry is not None:
        registry.count_request(message[1], message[2])
    elif kind == "scrape" and registry is not None:
        frontends.send_to(message[1], ("scraped", message[2], registry.render()))
