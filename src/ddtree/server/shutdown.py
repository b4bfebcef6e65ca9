"""Graceful shutdown: the first SIGTERM / SIGINT drains, a second one ends at once.

On the first signal the server keeps listening but refuses new requests (503 shutting_down,
/health 503 "draining"), lets the running ones finish for up to `drain_s`, then fails what is left
(a 503, or mid-stream an error event), frees every page, and only then tells uvicorn to exit (its
own shutdown then closes the connections). The process exits 0, with no traceback. A second signal
is uvicorn's: it stops serving at once and the signal is delivered again after the exit.
"""

from __future__ import annotations

import logging
import threading
import time

import uvicorn

log = logging.getLogger("ddtree.server")


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, scheduler, drain_s: float):
        super().__init__(config)
        self.scheduler, self.drain_s = scheduler, drain_s
        self._draining = False

    def handle_exit(self, sig, frame) -> None:
        if self._draining:
            return super().handle_exit(sig, frame)
        self._draining = True
        self.scheduler.begin_drain()
        log.info("shutting down: no new requests; draining the running ones for up to %g s", self.drain_s)
        threading.Thread(target=self._drain, name="ddtree-drain", daemon=True).start()

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
        self.should_exit = True
