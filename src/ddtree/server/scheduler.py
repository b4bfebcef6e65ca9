"""The scheduler thread: the one owner of the Engine, running continuous batching.

Each turn of its loop takes the HTTP side's submissions and aborts from an inbox, then runs one
engine step: the engine admits the waiting requests whose worst case fits the free pages, launches
one round for the whole batch and reads the previous one (Engine overlap: tokens reach clients one
round after the device committed them); finished requests leave as soon as that read shows it. New
requests therefore join between rounds, and a disconnected client's abort is applied at the next
step (a round already launched for it is discarded, its pages freed).

Deadlines (Limits.request_timeout_s) are checked every turn: an expired request is failed with
504 and aborted, whatever its state. A drain (graceful shutdown) refuses new submissions and lets
the running ones finish, until end_drain() fails what is left.

Failures stay contained: an error while preparing or delivering one request fails that request
alone (500, logged with its id); an error inside `engine.step()`, which no request can be blamed
for, fails the requests that were running in it, aborts them, and the loop goes on.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import queue
import threading
import time

import torch

from ..engine.pages import KVCacheFull
from ..parallel.relay import RankLost
from .errors import APIError, internal_error
from .jobs import Accepted, Failed, Handle, Job
from .limits import Limits
from .live import Live
from .metrics import Metrics, graph_counts
from .prompts import encode, sampling_params

log = logging.getLogger("ddtree.server")


class QueueFull(Exception):
    """The bounded queue of requests waiting for a batch slot is full."""


class Scheduler:
    def __init__(self, engine, metrics: Metrics, *, max_queue: int = 256, idle_wait_s: float = 0.1,
                 limits: Limits | None = None, on_turn=None, handle_of=None, detokenize: bool = True):
        """engine: an Engine used from this scheduler's thread only; max_queue: requests accepted
        but not yet in the batch (inbox + the engine's waiting queue) before submit refuses;
        limits: prompt length and request deadline (the rest is the HTTP side's). In an engine-core
        process (engine_core.py): on_turn(snapshot) ends every turn of the loop (and follows a
        drain that accepted requests, before the step: their Accepted go out first), handle_of(id)
        makes the handles that submit returns, and detokenize=False leaves the text and the stop
        strings to the HTTP process (chunks carry token ids; server/outputs.py)."""
        self.engine, self.metrics, self.max_queue, self.idle_wait_s = engine, metrics, max_queue, idle_wait_s
        self.on_turn, self.handle_of, self.detokenize = on_turn, handle_of, detokenize
        self.limits = limits or Limits()
        self._draining = threading.Event()
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._live: dict[str, Live] = {}  # scheduler thread only
        self._lock = threading.Lock()  # guards _queued, and orders submit's put against stop
        self._queued = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.fatal: str | None = None  # why the loop ended on its own (a tensor-parallel rank lost)
        self.on_fatal = None  # called (scheduler thread) once the loop ended on its own: one process ends the server
        self.snapshot: dict = {}
        self._publish()

    # -- the HTTP side (any thread) ----------------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="ddtree-scheduler", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 30.0) -> None:
        with self._lock:  # after this no submit puts: the thread's final drain sees every job put before
            self._stop.set()
        self._inbox.put(None)
        if self._thread is not None:
            self._thread.join(timeout_s)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stop.is_set()

    @property
    def draining(self) -> bool:
        return self._draining.is_set()

    def begin_drain(self) -> None:
        """Refuse new submissions (503 shutting_down); the accepted ones go on."""
        with self._lock:
            self._draining.set()

    def end_drain(self, request_ids: list[str] | None = None) -> None:
        """Fail every request still held (or those of request_ids among them: one API process's)
        with 503 shutting_down (mid-stream an error event), freeing its pages; applied at the
        thread's next turn."""
        self._inbox.put(("fail_all", request_ids))

    @property
    def idle(self) -> bool:
        """Nothing accepted is waiting or running (read from the last snapshot and the queue count)."""
        return self._queued == 0 and self.snapshot.get("running", 0) == 0 and self.snapshot.get("live", 0) == 0

    def submit(self, job: Job, loop=None) -> Handle:
        """Queue a job; its events arrive in the returned handle (on `loop`). Raises QueueFull, or
        RuntimeError once the scheduler is stopping."""
        handle = Handle(job.request_id, loop) if self.handle_of is None else self.handle_of(job.request_id)
        with self._lock:  # the stop check and the put together: stop() cannot fall between them
            if self._stop.is_set() or self._draining.is_set():
                raise RuntimeError("the server is shutting down")
            if self._queued >= self.max_queue:
                raise QueueFull(f"{self._queued} requests are waiting (max_queue={self.max_queue})")
            self._queued += 1
            self._inbox.put(("submit", job, handle))
        return handle

    def abort(self, request_id: str) -> None:
        """Drop a request (client gone); applied before the next round. Unknown ids are ignored."""
        self._inbox.put(("abort", request_id))

    # -- the loop (scheduler thread) -------------------------------------------------------------

    def _run(self) -> None:
        # Intra-op threads are set per thread: without this the scheduler's CPU rounds run on
        # every core, whatever the process set, and contend with the event loop.
        torch.set_num_threads(torch.get_num_threads())
        while not self._stop.is_set():
            try:
                accepted = self._drain(block=not self.engine.has_unfinished())
                if accepted and self.on_turn is not None:  # their Accepted out before the step (an engine
                    self.on_turn(self.snapshot)  # core): the HTTP side starts each response while it runs
                if self.engine.has_unfinished() and not self._stop.is_set():
                    self._step()
                self._expire()
            except RankLost as err:  # no step can run again: fail everything and end (the server ends with it)
                self.fatal = str(err)
                log.error("scheduler: %s; failing every request", err)
                for rid in list(self._live):
                    self._fail(rid, APIError(503, f"{err}; this server is shutting down", code="engine_dead"))
                self._stop.set()  # this turn's failures still go out below
            except Exception:  # a bug outside any one request: never let the thread die silently
                log.exception("scheduler: unexpected error; failing the requests in flight")
                for rid in list(self._live):
                    self._fail(rid, internal_error(rid))
            self._publish()
            if self.on_turn is not None:
                self.on_turn(self.snapshot)
        for rid in list(self._live):  # shutting down
            self._fail(rid, APIError(503, "the server is shutting down", code="shutting_down"))
        self._drain(block=False)
        self._publish()
        if self.on_turn is not None:
            self.on_turn(self.snapshot)
        if self.fatal is not None and self.on_fatal is not None:
            self.on_fatal()

    def _drain(self, block: bool) -> bool:
        """Apply what the inbox holds (waiting up to idle_wait_s for a first item when `block`);
        returns whether a submission was among it."""
        try:
            item = self._inbox.get(timeout=self.idle_wait_s) if block else self._inbox.get_nowait()
        except queue.Empty:
            return False
        submitted = False
        while True:
            if item is not None:  # None only wakes the loop (stop)
                if item[0] == "submit":
                    submitted = True
                    self._accept(item[1], item[2])
                elif item[0] == "fail_all":
                    for rid in list(self._live) if item[1] is None else [r for r in item[1] if r in self._live]:
                        self._fail(rid, APIError(503, "the server is shutting down", code="shutting_down"))
                else:
                    self._abort(item[1])
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return submitted

    def _accept(self, job: Job, handle: Handle) -> None:
        rid = job.request_id
        if self._stop.is_set():
            return self._reject(handle, APIError(503, "the server is shutting down", code="shutting_down"))
        try:
            ids = encode(self.engine, job)
            self.limits.check_prompt(len(ids), job.prompt_param)
            params = sampling_params(self.engine, job, len(ids))
            if not self.detokenize:  # the HTTP process finds them in the text it decodes
                params = dataclasses.replace(params, stop=())
            self.engine.add_request(ids, params, mode=job.mode, budget=job.budget, request_id=rid,
                                    detokenize=self.detokenize)
        except APIError as err:
            return self._reject(handle, err)
        except KVCacheFull as err:
            return self._reject(handle, APIError(400, str(err), param=job.limit_param, code="context_length_exceeded"))
        except ValueError as err:
            return self._reject(handle, APIError(400, str(err), code="invalid_value"))
        except Exception:
            log.exception("request %s: failed while being added to the engine", rid)
            return self._reject(handle, internal_error(rid))
        self._live[rid] = Live(job, handle, len(ids), time.perf_counter())
        self.metrics.prompt_tokens.inc(len(ids))
        handle.push(Accepted(len(ids)))

    def _reject(self, handle: Handle, error: APIError) -> None:
        self._unqueue()
        handle.push(Failed(error))

    def _unqueue(self) -> None:
        with self._lock:
            self._queued -= 1

    def _abort(self, rid: str) -> None:
        live = self._live.pop(rid, None)
        if live is None:  # already finished or failed
            return
        if not live.started:
            self._unqueue()
        self._forget(rid)
        log.info("request %s: aborted (client gone, or its text reached a stop string) after %d tokens", rid,
                 live.produced)

    def _forget(self, rid: str) -> None:
        """Remove a request from the engine whatever its state; its slot and pages are free after."""
        try:
            self.engine.abort(rid)  # any state, a finished result not yet taken included
        except KeyError:  # not in the engine
            pass
        except Exception:  # an engine left inconsistent by a failed step: keep serving the others
            log.exception("request %s: the engine could not abort it", rid)

    def _fail(self, rid: str, error: APIError) -> None:
        live = self._live.pop(rid, None)
        if live is None:
            return
        if not live.started:
            self._unqueue()
        self._forget(rid)
        live.handle.push(Failed(error))

    def _expire(self) -> None:
        """Fail the requests past their deadline (504), whatever their state."""
        timeout = self.limits.request_timeout_s
        if timeout is None or not self._live:
            return
        now = time.perf_counter()
        for rid, live in list(self._live.items()):
            if now - live.accepted_at > timeout:
                log.info("request %s: past its deadline of %g s after %d tokens; aborted", rid, timeout, live.produced)
                self._fail(rid, APIError(504, f"the request took longer than this server's limit of {timeout:g} s "
                                         "(--request-timeout); it was stopped", code="request_timeout"))

    def _step(self) -> None:
        start = time.perf_counter()
        try:
            outputs = self.engine.step()
        except Exception as err:
            self.metrics.engine_failures.inc()
            if isinstance(err, RankLost):
                raise  # no step can run again: the loop ends (_run)
            self._fail_running()
            return
        now = time.perf_counter()
        self.metrics.round_seconds.observe(now - start)
        ours = []
        for out in outputs:
            live = self._live.get(out.request_id)
            if live is not None:
                ours.append((live, out))
            elif out.finished:  # not ours (cannot happen through the server): do not let it leak
                self._forget(out.request_id)
        # counted once a step (an engine core sends each update), before the chunks that hold them go out
        committed = sum(len(out.new_token_ids) for _, out in ours)
        if committed:
            self.metrics.generated_tokens.inc(committed)
        for live, out in ours:
            try:
                self._deliver(live, out, now)
            except Exception:
                log.exception("request %s: failed while delivering its tokens", out.request_id)
                self._fail(out.request_id, internal_error(out.request_id))

    def _fail_running(self) -> None:
        """After engine.step() raised: fail every request that was in the batch; requests the
        engine still holds as waiting stay queued."""
        def waiting(rid: str) -> bool:
            try:
                return self.engine.request_state(rid) == "waiting"
            except KeyError:
                return False

        failed = [rid for rid in self._live if not waiting(rid)]
        log.exception("engine step failed; failing the %d requests in the batch: %s", len(failed), ", ".join(failed))
        for rid in failed:
            self._fail(rid, internal_error(rid))

    def _deliver(self, live: Live, out, now: float) -> None:
        """Push the step's output to its request's handle."""
        first = not live.started
        count = len(out.new_token_ids)
        live.record(count)  # started from here: a failure below does not unqueue it again (_fail)
        if first:
            self._unqueue()
            self.metrics.time_to_first_token.observe(now - live.accepted_at)
        tokens = tuple(out.new_token_ids)
        if not out.finished:
            live.handle.push_chunk(out.new_text or "", count, live.usage_so_far(), None, tokens)
            return
        result = self.engine.take_result(out.request_id)
        del self._live[out.request_id]
        stats = result.stats
        self.metrics.acceptance_length.observe_counts(collections.Counter(stats.acceptance_lengths))
        self.metrics.tree_size.observe_counts(collections.Counter(stats.tree_sizes))
        self.metrics.request_seconds.observe(now - live.accepted_at)
        live.handle.push_chunk(out.new_text or "", count, live.final_usage(result), out.finish_reason, tokens)

    def _publish(self) -> None:
        blocks = self.engine.blocks
        snapshot = {"running": self.engine.num_running, "queued": self._queued, "live": len(self._live),
                    "pages_free": blocks.num_free, "pages_in_use": blocks.num_pages - blocks.num_free,
                    "pages_promised": blocks.num_promised, "pages_total": blocks.num_pages,
                    **graph_counts(self.engine)}
        self.snapshot = snapshot
        self.metrics.publish(snapshot)
