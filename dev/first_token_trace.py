"""Where a served request's first token spends its time: `ddtree serve`'s two processes (the demo
pair, the engine core built as serve builds it) with marks at each hop, and one client process
sending requests one at a time. Prints, per hop, the median time since the client sent and the
server's first request's; --profile adds cProfile of the core's first step for the first request
and for the first measured one.

    python dev/first_token_trace.py --device cuda --requests 30 --mode ar

Marks are time.perf_counter_ns (CLOCK_MONOTONIC: one clock for every process on Linux), appended
to one file; each costs a write, a few microseconds.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "dev"))

LOG = os.environ.setdefault("DDTREE_TRACE_LOG", os.path.join(tempfile.mkdtemp(prefix="ddtree-trace-"), "marks"))

CLIENT = r"""
import json, socket, sys, time, httpx
log, url, n, mode, kind = open(sys.argv[1], "a", buffering=1), sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5]
body = dict(model="ddtree-demo", prompt="def fib(n):", max_tokens=8, temperature=0.0, stream=True, ignore_eos=True,
            ddtree={"mode": mode} if mode == "ar" else {"mode": "ddtree", "budget": 16})
if kind == "raw":  # the request's bytes built once, one kept-alive socket: the client's own cost near zero
    host, port = url.split("//")[1].split(":")
    data = json.dumps(body).encode()
    request = (f"POST /v1/completions HTTP/1.1\r\nhost: {host}\r\ncontent-type: application/json\r\n"
               f"content-length: {len(data)}\r\n\r\n").encode() + data
    sock = socket.create_connection((host, int(port)))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for i in range(n + 3):  # the first three warm up
        time.sleep(0.02)
        log.write(f"{time.perf_counter_ns()} {i} client_send\n")
        sock.sendall(request)
        seen = b""
        while b"data:" not in seen:
            seen += sock.recv(65536)
        log.write(f"{time.perf_counter_ns()} {i} client_first_event\n")
        while not seen.endswith(b"0\r\n\r\n"):  # the chunked body's end
            seen += sock.recv(65536)
    sys.exit()
if kind == "aiohttp":  # serve_bench's default client library
    import asyncio, aiohttp

    async def run():
        async with aiohttp.ClientSession() as session:
            for i in range(n + 3):  # the first three warm up
                await asyncio.sleep(0.02)
                log.write(f"{time.perf_counter_ns()} {i} client_send\n")
                first = True
                async with session.post(url + "/v1/completions", json=body) as resp:
                    async for line in resp.content:
                        if line.startswith(b"data:") and first:
                            log.write(f"{time.perf_counter_ns()} {i} client_first_event\n")
                            first = False

    asyncio.run(run())
    sys.exit()
with httpx.Client(timeout=60) as client:
    for i in range(n + 3):  # the first three warm up
        time.sleep(0.02)
        log.write(f"{time.perf_counter_ns()} {i} client_send\n")
        first = True
        with client.stream("POST", url + "/v1/completions", json=body) as resp:
            for line in resp.iter_lines():
                if line.startswith("data:") and first:
                    log.write(f"{time.perf_counter_ns()} {i} client_first_event\n")
                    first = False
"""


class Marks:
    """Appends `time request-index name` lines; the request index counts submissions in this process."""

    def __init__(self):
        self.file = open(LOG, "a", buffering=1)
        self.count = 0

    def mark(self, name: str, index: int | None = None) -> None:
        self.file.write(f"{time.perf_counter_ns()} {self.count - 1 if index is None else index} {name}\n")


def wrap(marks: Marks, cls, name: str, label: str, first_only: bool = False, counts: bool = False) -> None:
    original = getattr(cls, name)
    seen: set[int] = set()

    @functools.wraps(original)
    def traced(*args, **kwargs):
        if counts:
            marks.count += 1
        index = marks.count - 1
        if not (first_only and index in seen):
            marks.mark(f"{label}_in")
        try:
            return original(*args, **kwargs)
        finally:
            if not (first_only and index in seen):
                marks.mark(f"{label}_out")
                seen.add(index)

    setattr(cls, name, traced)


PROFILED = (0, 3)  # the server's first request and the first measured one


def profile_first_steps(marks: Marks, scheduler_cls) -> None:
    """cProfile of the scheduler's first step for each request in PROFILED (its admission, prefill
    and first round), dumped beside the marks as <LOG>.step<i>.prof."""
    import cProfile

    inner, done = scheduler_cls._step, set()

    def profiled(self, *args, **kwargs):
        index = marks.count - 1
        if index not in PROFILED or index in done:
            return inner(self, *args, **kwargs)
        done.add(index)
        profile = cProfile.Profile()
        try:
            return profile.runcall(inner, self, *args, **kwargs)
        finally:
            profile.dump_stats(f"{LOG}.step{index}.prof")

    scheduler_cls._step = profiled


def print_profiles() -> None:
    import pstats

    for index in PROFILED:
        path = f"{LOG}.step{index}.prof"
        if os.path.exists(path):
            stats = pstats.Stats(path)
            print(f"\nthe core's first step for request {index}: {stats.total_tt * 1e3:.1f} ms (cProfile), by own time")
            stats.sort_stats("tottime").print_stats(14)


def traced_core_build(args):
    """Runs in the engine-core process: serve's own build, then the core's hops marked."""
    from ddtree.server.command import load_for_serving
    from ddtree.server.frontends import Frontends
    from ddtree.server.scheduler import Scheduler

    marks = Marks()
    wrap(marks, Scheduler, "_accept", "core_accept", counts=True)
    if os.environ.get("DDTREE_TRACE_PROFILE"):
        profile_first_steps(marks, Scheduler)
    wrap(marks, Scheduler, "_step", "core_step", first_only=True)
    send_turn = Frontends.send_turn

    def traced_send_turn(self, events, *rest, **kwargs):
        if events:
            marks.mark("core_send")
        return send_turn(self, events, *rest, **kwargs)

    Frontends.send_turn = traced_send_turn
    return load_for_serving(args)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--requests", type=int, default=30)
    parser.add_argument("--mode", choices=["ar", "ddtree"], default="ar")
    parser.add_argument("--client", choices=["httpx", "aiohttp", "raw"], default="httpx",
                        help="httpx (sync), aiohttp (serve_bench's default) or raw: the request's bytes on one "
                             "socket, no client library")
    parser.add_argument("--profile", action="store_true",
                        help="cProfile the core's first step of the first request and of the first measured one")
    args = parser.parse_args()
    if args.profile:
        os.environ["DDTREE_TRACE_PROFILE"] = "1"  # the core process inherits it

    from serving_host_cost import serve

    import ddtree.server.app as app_module
    from ddtree.cli import build_parser
    from ddtree.server import responses
    from ddtree.server.app import ServerConfig, create_app
    from ddtree.server.command import serving_facts
    from ddtree.server.engine_core import EngineCore

    serve_args = build_parser().parse_args(["serve", "--device", args.device, "--max-batch", "4"])
    marks = Marks()
    wrap(marks, EngineCore, "submit", "http_submit", counts=True)
    wrap(marks, EngineCore, "_route", "http_route", first_only=True)
    wrap(marks, responses.ResponseShape, "chunk_event", "http_first_event", first_only=True)
    original_generate = app_module.generate  # the app calls its own reference to handler.generate

    async def traced_generate(*a, **k):
        marks.mark("http_handler_in", marks.count)
        return await original_generate(*a, **k)

    app_module.generate = traced_generate
    read_json = app_module.read_json

    async def traced_read_json(*a, **k):
        marks.mark("http_body_in", marks.count)
        try:
            return await read_json(*a, **k)
        finally:
            marks.mark("http_body_out", marks.count)

    app_module.read_json = traced_read_json
    core = EngineCore(functools.partial(traced_core_build, serve_args), serving_facts, max_queue=64)
    core.launch()
    app = create_app(core, ServerConfig(model_name="ddtree-demo", default_mode="ar"))

    async def entry(scope, receive, send):  # uvicorn hands the request over: the client's and the parse's time before
        if scope["type"] == "http" and scope["path"] == "/v1/completions":
            marks.mark("http_asgi_in", marks.count)
        return await app(scope, receive, send)

    url, server = serve(entry)
    try:
        open(LOG, "w").close()
        subprocess.run([sys.executable, "-c", CLIENT, LOG, url, str(args.requests), args.mode, args.client],
                       check=True)
    finally:
        server.should_exit = True
        core.stop()
    report(args.requests)
    if args.profile:
        print_profiles()


def report(requests: int) -> None:
    by_request: dict[int, dict[str, int]] = {}
    for line in open(LOG):
        t, index, name = line.split()
        by_request.setdefault(int(index), {}).setdefault(name, int(t))
    rows = [marks for i, marks in by_request.items() if i >= 3 and "client_send" in marks]
    names = sorted({n for r in rows for n in r}, key=lambda n: statistics.median(r[n] - r["client_send"] for r in rows if n in r))
    first = by_request.get(0, {})  # the server's first request: what a fresh server adds to it
    print(f"{len(rows)} requests after 3 unmeasured; median ms after the client sent (and the server's first request's)")
    for name in names:
        got = [(r[name] - r["client_send"]) / 1e6 for r in rows if name in r]
        alone = f"{(first[name] - first['client_send']) / 1e6:8.3f}" if name in first and "client_send" in first else "       -"
        print(f"  {name:22s} {statistics.median(got):7.3f}   (p90 {sorted(got)[int(0.9 * (len(got) - 1))]:.3f}, n {len(got)})"
              f"   first {alone}")


if __name__ == "__main__":
    main()
