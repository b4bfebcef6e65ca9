"""The engine core's sockets to the API-server processes (`ddtree serve --api-server-count N`; one
by default): which process each live request came from, its events to that process, the metric
updates and the snapshot to every process (at most every SPREAD_S to one without events of its
own), and, with several, the answers to their scrapes (the core then keeps the one registry).
"""

from __future__ import annotations

import threading
import time

import zmq

from .jobs import Failed
from .wire import to_wire

SPREAD_S = 0.05  # how stale a process's metrics and snapshot may get while none of its requests commits


def _ends(item: tuple) -> bool:
    """Whether a request's event (as to_wire leaves it) is its last: a failure, or its last chunk."""
    return item[4] is not None if len(item) == 6 else type(item[1]) is Failed


class Frontends:
    """The API-server processes' output sockets, and which process each live request came from.
    Sends come from the scheduler thread (turns) and the core's main thread (scrapes): one lock."""

    def __init__(self, context, addresses: list[str]):
        self.sockets = []
        for address in addresses:
            sock = context.socket(zmq.PUSH)
            sock.setsockopt(zmq.SNDHWM, 0)  # queue without bound: a slow HTTP side never stalls a round
            sock.connect(address)
            self.sockets.append(sock)
        self.of: dict[str, int] = {}  # request id -> its process's index, from its submission to its last event
        self.detached: set[int] = set()  # processes that have ended
        count = len(addresses)
        self.pending: list[list] = [[] for _ in range(count)]  # metric updates not yet sent to each process
        self.snapshot_sent: list[dict | None] = [None] * count
        self.sent_at = [0.0] * count
        self.lock = threading.Lock()

    def send_all(self, message) -> None:
        with self.lock:
            for sock in self.sockets:
                sock.send_pyobj(message)

    def send_to(self, index: int, message) -> None:
        with self.lock:
            self.sockets[index].send_pyobj(message)

    def send_turn(self, events: list, updates: list, snapshot: dict, force: bool = False) -> None:
        """Each process its requests' events, every process the updates and the snapshot: at once
        with events of its own, else at most every SPREAD_S (or `force`), so that processes without
        requests in a turn are not woken by it. Events of requests no process waits for (aborted)
        are dropped."""
        mine = [[] for _ in self.sockets]
        for item in to_wire(events):
            index = self.of.get(item[0])
            if index is not None:
                mine[index].append(item)
            if _ends(item):  # a request's last event: no later one in this turn
                self.of.pop(item[0], None)
        now = time.monotonic()
        with self.lock:
            for index, (sock, events_here) in enumerate(zip(self.sockets, mine)):
                pending = self.pending[index]
                pending.extend(updates)
                if not (events_here or (force or now - self.sent_at[index] >= SPREAD_S)
                        and (pending or snapshot != self.snapshot_sent[index])):
                    continue
                sock.send_pyobj(("turn", events_here, pending, snapshot))  # never blocks: no bound
                self.pending[index], self.snapshot_sent[index], self.sent_at[index] = [], snapshot, now

    def requests_of(self, index: int) -> list[str]:
        return [rid for rid, at in list(self.of.items()) if at == index]

    def close(self) -> None:
        for sock in self.sockets:
            sock.close(linger=2000)
