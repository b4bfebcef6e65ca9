"""Streamed clients spread over processes, and the CPU time of the server's processes.

One asyncio loop parsing every SSE event of 64 fast streams can be the slowest part of a serving
benchmark, so a cell's clients run in several processes (serve_bench's client in each, its share
of the concurrency and of the requests), all started at one wall-clock instant. Beside each cell,
the CPU seconds the server's processes (the HTTP process and its children: the engine core) and
the busiest client process used, over the cell's wall time: a figure near 1.0 is a process that
ran the whole time, the likely bottleneck.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import time
from pathlib import Path

START_DELAY_S = 0.5  # the client processes' common start, after the tasks reach them


def _part(url: str, bodies: list[dict], concurrency: int, start_at: float,
          client_kind: str) -> tuple[list[dict], float, float, float]:
    """One client process's share: (records, its start, its end (time.time), its CPU seconds)."""
    from serve_bench import open_client, run_cell

    async def run():
        async with open_client(client_kind, concurrency + 4) as client:
            time.sleep(max(0.0, start_at - time.time()))
            cpu = time.process_time()
            start = time.time()
            records, _ = await run_cell(client, url, bodies, concurrency)
            return records, start, time.time(), time.process_time() - cpu

    return asyncio.run(run())


class ClientPool:
    """`processes` client processes (spawned once, reused by every cell), each streaming with the
    `client` library (serve_bench.CLIENTS); a context manager."""

    def __init__(self, processes: int, client: str = "aiohttp"):
        if processes < 1:
            raise ValueError(f"client processes must be >= 1, got {processes}")
        self.processes, self.client = processes, client
        self._pool = multiprocessing.get_context("spawn").Pool(processes)

    def __enter__(self) -> ClientPool:
        return self

    def __exit__(self, *exc) -> None:
        self._pool.terminate()
        self._pool.join()

    def run(self, url: str, bodies: list[dict], concurrency: int) -> tuple[list[dict], float, float]:
        """All bodies through `concurrency` streams split over min(processes, concurrency) processes:
        (records, wall seconds from the common start to the last end, the busiest process's CPU
        seconds over that wall time)."""
        parts = min(self.processes, concurrency)
        start_at = time.time() + START_DELAY_S
        tasks = [(url, bodies[i::parts], concurrency // parts + (i < concurrency % parts), start_at, self.client)
                 for i in range(parts)]
        results = self._pool.starmap(_part, tasks)
        wall = max(end for _, _, end, _ in results) - start_at
        records = [r for part, _, _, _ in results for r in part]
        return records, wall, max(cpu for _, _, _, cpu in results) / wall


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process `pid` so far (Linux /proc; 0.0 once it has gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def children(pid: int) -> list[int]:
    """The processes whose parent is `pid`: the children its threads started (Linux /proc)."""
    found = []
    for task in Path(f"/proc/{pid}/task").glob("*/children"):
        try:
            found += [int(child) for child in task.read_text().split()]
        except OSError:  # the thread ended meanwhile
            continue
    return found


class ServerCpu:
    """CPU seconds of a server's HTTP process and of its engine core (`core_pid`, or else the
    HTTP process's children) between `start()` and `fractions(wall)`; with core_pid and
    other_http (True), the HTTP process's other children count as HTTP processes (the API servers
    of `ddtree serve --api-server-count N`)."""

    def __init__(self, pid: int, core_pid: int | None = None, other_http: bool = False):
        self.pid, self.core_pid, self.other_http = pid, core_pid, other_http

    def start(self) -> None:
        if self.core_pid is None:
            self._http, self._core = [self.pid], children(self.pid)
        else:
            others = [p for p in children(self.pid) if p != self.core_pid] if self.other_http else []
            self._http, self._core = [self.pid] + others, [self.core_pid]
        self._before = {p: cpu_seconds(p) for p in self._http + self._core}

    def fractions(self, wall: float) -> dict:
        """{"http_cpu": the busiest HTTP process's CPU seconds / wall, "http_cpu_sum": all of theirs,
        "core_cpu": the core's (the busiest child's)}."""
        used = {p: cpu_seconds(p) - before for p, before in self._before.items()}
        http = [used[p] for p in self._http]
        return {"http_cpu": max(http) / wall, "http_cpu_sum": sum(http) / wall,
                "core_cpu": max((used[p] for p in self._core), default=0.0) / wall}
