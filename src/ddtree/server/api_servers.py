"""Several API-server processes over one engine core: `ddtree serve --api-server-count N`, as vLLM's
option of that name. One process's interpreter decodes, formats and writes every stream; at many
streams it is the server's bottleneck, so N processes share the listening sockets (the kernel hands
each connection to one of them) and the work.

The process `ddtree serve` runs is API server 0: it launches the core, then starts servers 1..N-1
(spawned, the sockets passed down), each attaching to the core over sockets of its own
(engine_core.py). It owns their lifetime: SIGTERM / SIGINT reach it and it passes SIGTERM on (each
drains its own requests; SIGINT alone from a terminal reaches all and only server 0 acts on it); a
core that dies is reported to each, which fails its requests with 503 and ends; one that ends
unexpectedly ends the server with a one-line error. Each counts 1/N of --max-queue and
--max-streams; every one reports the totals in /metrics (the core passes the counts to all).
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import threading
import time

import zmq

from .engine_core import EngineCore
from .running import exit_on_signal, run_app, serving_limits

log = logging.getLogger("ddtree.server")


def share(total: int | None, count: int) -> int | None:
    """One API server's part of a limit over all of them (rounded up; None: no limit)."""
    return None if total is None else -(-total // count)


def shared_limits(limits, count: int):
    """The limits one of `count` API servers applies (--max-streams shared)."""
    return dataclasses.replace(limits, max_streams=share(limits.max_streams, count))


class ApiServers:
    """API servers 1..count-1, seen from server 0. One that ends unless told to (or with a non-zero
    code while draining) is detached from the core (`detach(index)`) and ends the server
    (`end_server()`, once); `failed` then says which and how."""

    def __init__(self, count: int, sockets, args, keys, directory: str):
        self.count, self.sockets, self.args, self.keys, self.directory = count, sockets, args, keys, directory
        self.processes: list[multiprocessing.Process] = []
        self.failed: str | None = None
        self.detach = self.end_server = None
        self._told = threading.Event()  # SIGTERM passed on: a server that ends with 0 drained
        self._core_dead = threading.Event()  # they end with 1 by themselves
        self._forcing = threading.Event()  # stop() ends them at once

    def start(self) -> None:
        context = multiprocessing.get_context("spawn")
        for index in range(1, self.count):
            process = context.Process(target=api_server_main, name=f"ddtree-api-server-{index}", daemon=True,
                                      args=(index, self.count, self.directory, self.sockets, self.args, self.keys))
            process.start()
            self.processes.append(process)
        threading.Thread(target=self._watch, name="ddtree-api-server-watch", daemon=True).start()

    def _watch(self) -> None:
        running = {process.sentinel: index for index, process in enumerate(self.processes, 1)}
        while running:
            for sentinel in multiprocessing.connection.wait(list(running), timeout=0.5):
                index = running.pop(sentinel)
                code = self._exit_code(self.processes[index - 1])
                # told to end: a drain ends with 0; our SIGTERM before its handlers existed (it was starting:
                # nothing of its own ran) ends it with -SIGTERM
                told = self._told.is_set() and code in (0, -signal.SIGTERM)
                if self._core_dead.is_set() or self._forcing.is_set() or told:
                    continue
                log.error("API server %d ended unexpectedly (exit code %s); shutting the server down", index, code)
                if self.detach is not None:  # its requests: nobody waits for them now
                    self.detach(index)
                if self.failed is None:
                    self.failed = f"API server {index} ended unexpectedly (exit code {code})"
                    if not self._told.is_set() and self.end_server is not None:
                        self.end_server()

    @staticmethod
    def _exit_code(process: multiprocessing.Process) -> int | None:
        """Its exit code once its sentinel closed: the sentinel closes a moment before the process can
        be reaped, and another thread (wait, is_alive) may be reaping it at that moment (waitpid
        then fails here with ECHILD and exitcode is None until that thread has set it)."""
        deadline = time.monotonic() + 5
        while process.exitcode is None and time.monotonic() < deadline:
            time.sleep(0.01)
        return process.exitcode

    def signal(self, sig: int = signal.SIGTERM) -> None:
        """Pass a signal on to every server still running (the first SIGTERM: each drains)."""
        self._told.set()
        for process in self.processes:
            if process.is_alive():
                try:
                    os.kill(process.pid, sig)
                except ProcessLookupError:
                    pass

    def wait(self, timeout_s: float) -> bool:
        """Wait until every server has ended; whether they all did within timeout_s."""
        deadline = time.monotonic() + timeout_s
        for process in self.processes:
            process.join(max(0.0, deadline - time.monotonic()))
        return not any(process.is_alive() for process in self.processes)

    def core_died(self, why: str) -> None:
        """Tell every server that the core died (on its own socket, as the core would have): each
        fails its requests with 503 and ends. From a thread of its own: closing the sockets may
        wait for a server that has gone, and the caller is the event loop."""
        self._core_dead.set()
        threading.Thread(target=self._tell_died, args=(why,), name="ddtree-api-server-died", daemon=True).start()

    def _tell_died(self, why: str) -> None:
        context = zmq.Context()
        try:
            for index in range(1, self.count):
                sock = context.socket(zmq.PUSH)
                sock.connect(EngineCore.address(self.directory, "from_core", index))
                sock.send_pyobj(("died", why))
                sock.close(linger=1000)
        finally:
            context.term()

    def stop(self, timeout_s: float = 5.0) -> None:
        """End every server still running: SIGTERM (a second one ends a draining server at once),
        then SIGKILL past timeout_s."""
        if any(process.is_alive() for process in self.processes):
            self._forcing.set()
            self.signal(signal.SIGTERM)
        if not self.wait(timeout_s):
            for process in self.processes:
                if process.is_alive():
                    process.kill()
            self.wait(5)


def api_server_main(index: int, count: int, directory: str, sockets, args, keys) -> None:
    """API server `index` (> 0): attach to the core server 0 launched, then serve until told to stop.
    Exits 0 after a drain, 1 when the core died or server 0 ended (server 0 prints the error)."""
    # until uvicorn's handlers are in place: server 0's SIGTERM ends this one once it serves (at once:
    # nothing of its own runs yet), a terminal's SIGINT is server 0's to act on
    ending = threading.Event()
    signal.signal(signal.SIGTERM, lambda _signum, _frame: ending.set())
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    limits = shared_limits(serving_limits(args), count)
    engine = EngineCore.attached(directory, index, count, max_queue=share(args.max_queue, count), limits=limits)
    try:
        facts = engine.connect()
    except RuntimeError as err:
        log.error("API server %d: %s", index, err)
        raise SystemExit(1)
    engine.on_death = lambda: None if engine.draining else exit_on_signal()
    try:
        code = run_app(sockets, args, keys, limits, engine, facts, announce=False, ending=ending)
    finally:
        engine.stop(timeout_s=5)
    raise SystemExit(code)
