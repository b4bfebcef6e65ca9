"""Graceful shutdown: the first SIGTERM / SIGINT drains, a second one ends at once.

On the first signal the server keeps listening but refuses new requests (503 shutting_down,
/health 503 "draining"), lets the running ones finish for up to `drain_s`, then fails what is left
(a 503, or mid-stream an error event), frees every page, and only then tells uvicorn to exit (its
own shutdown then closes the connections). The process exits 0, with no traceback. Other API-server
processes (api_servers.py) get the signal too, drain their own requests, and are waited for. A second signal
is uvicorn's: it stops serving at once and the signal is delivered again after the exit.
"""

from __future__ import annotations

import logging
import signal
import threading
import time

import uvicorn

log = logging.getLogger("ddtree.server")


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, scheduler, drain_s: float, peers=None, signals=None, ending=None):
        """peers: the other API-server processes (api_servers.ApiServers): the first signal is passed
        on to them and they are waited for; signals: the ones acted on (None: uvicorn's); ending: a
        threading.Event whose setting is taken as a first SIGTERM (from any thread, even before the
        server runs and its signal handlers exist)."""
        super().__init__(config)
        self.scheduler, self.drain_s, self.peers, self.signals, self.ending = scheduler, drain_s, peers, signals, ending
        self._draining = False
        self._drain_started = 0.0

    def handle_exit(self, sig, frame) -> None:
        if self.signals is not None and sig not in self.signals:
            return
        if self._draining:
            return super().handle_exit(sig, frame)
        self._draining = True
        self._drain_started = time.monotonic()
        if self.peers is not None:
            self.peers.signal()
        self.scheduler.begin_drain()
        log.info("shutting down: no new requests; draining the running ones for up to %g s", self.drain_s)
        threading.Thread(target=self._drain, name="ddtree-drain", daemon=True).start()

    async def on_tick(self, counter: int) -> bool:
        if self.ending is not None and self.ending.is_set() and not self._draining:
            self.handle_exit(signal.SIGTERM, None)
        return await super().on_tick(counter)

    def _drain(self) -> None:
        deadline = time.monotonic() + self.drain_s
        while not self.scheduler.idle and time.monotonic() < deadline:
            time.sleep(0.05)
        if not self.scheduler.idle:
            log.info("drain deadline reached: failing the requests still running")
            self.scheduler.end_drain()
            settle = time.monotonic() + 5
            while not self.scheduler.idle and time.monotonic() < settle:
                time.sleep(0.05)
        if self.peers is not None:  # they drain as long, then close their connections
            self.peers.wait(self._drain_started + self.drain_s + 15 - time.monotonic())
        self.should_exit = True
