"""Host time of one serving turn on each side of the engine-core split, without sockets or
processes: the core's (Scheduler._deliver for R one-token outputs, the turn's wire tuples, its
pickle) and the HTTP process's (unpickle k turns, join them, route, decode, format each request's
SSE event), per token. Compare commits on one machine.

    python dev/serving_turn_cost.py --requests 64 --turns 1 2 4 8
"""

from __future__ import annotations

import argparse
import asyncio
import pickle
import random
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from ddtree.demo import demo_pair  # noqa: E402
from ddtree.engine.loading import load_tokenizer  # noqa: E402
from ddtree.server.core_process import _Outbox, _RecordedMetrics  # noqa: E402
from ddtree.server.engine_core import EngineCore  # noqa: E402
from ddtree.server.jobs import Chunk, Handle, Job, Usage  # noqa: E402
from ddtree.server.outputs import TextOutputs  # noqa: E402
from ddtree.server.responses import ResponseShape  # noqa: E402
from ddtree.server.live import Live  # noqa: E402
from ddtree.server.scheduler import Scheduler  # noqa: E402
from ddtree.server.wire import joined_from_wire, to_wire  # noqa: E402


def rid(r: int) -> str:
    return f"cmpl-{r:032x}"


def core_turn_us(requests: int, repeats: int) -> float:
    """One core turn: every request's output delivered, the turn's events as wire tuples, pickled."""
    outbox = _Outbox()
    scheduler = Scheduler.__new__(Scheduler)  # only what _deliver and its metrics touch
    scheduler.metrics, scheduler._live, scheduler._lock, scheduler._queued = _RecordedMetrics(outbox), {}, threading.Lock(), 0
    lives = []
    for r in range(requests):
        job = Job(rid(r), [1, 2, 3], None, 128, {"temperature": 0.0}, "ar", 1)
        lives.append(Live(job, outbox.handle(rid(r)), 20, 0.0, started=True))
    outputs = [SimpleNamespace(request_id=rid(r), new_token_ids=[7], finished=False, new_text=None, finish_reason=None)
               for r in range(requests)]

    def turn():
        for live, out in zip(lives, outputs):
            scheduler._deliver(live, out, 0.0)
        events, updates = outbox.take()
        return pickle.dumps(("turn", to_wire(events), updates, {"running": requests}))

    return best_of(turn, repeats, 100)


def http_us_per_token(tokenizer, requests: int, turns: int, repeats: int) -> float:
    """`turns` pickled turns of one-token chunks taken at one wake-up, as the HTTP process takes them."""
    rng = random.Random(0)

    def turn_messages(start: int) -> list[bytes]:
        out = []
        for t in range(turns):
            events = [(rid(r), Chunk("", 1, Usage(20, start + t + 1, "ar", None, start + t, 1.0), None,
                                     (rng.randrange(100, 2000),))) for r in range(requests)]
            out.append(pickle.dumps(("turn", to_wire(events), [], {"running": requests})))
        return out

    async def run(wakeups: int) -> float:
        core, loop = EngineCore(None, None), asyncio.get_running_loop()
        core._outputs = TextOutputs(tokenizer)
        shapes = {}
        for r in range(requests):
            core._handles[rid(r)] = Handle(rid(r), loop)
            core._outputs.open(rid(r), ())
            shapes[rid(r)] = ResponseShape("completion", rid(r), "demo")
        batches = [turn_messages(i * turns) for i in range(wakeups)]
        start = time.perf_counter()
        for messages in batches:
            events = []
            for message in messages:
                events.extend(pickle.loads(message)[1])
            core._route(joined_from_wire(events))
            for request_id, handle in core._handles.items():
                while not handle.queue.empty():
                    event = handle.coalesce(handle.queue.get_nowait())
                    shapes[request_id].chunk_event(event.text, event.finish_reason, event.usage)
        return (time.perf_counter() - start) / (wakeups * turns * requests) * 1e6

    return min(asyncio.run(run(max(8, 128 // turns))) for _ in range(repeats))


def best_of(fn, repeats: int, calls: int) -> float:
    for _ in range(calls // 2):
        fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls)
    return best * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--turns", type=int, nargs="+", default=[1, 2, 4, 8], help="turns per wake-up of the receiver")
    parser.add_argument("--repeats", type=int, default=9, help="the best of this many runs")
    args = parser.parse_args()
    print(f"core: a turn of {args.requests} one-token outputs {core_turn_us(args.requests, args.repeats):.0f} us")
    tokenizer = load_tokenizer(demo_pair()[0])
    for turns in args.turns:
        cost = http_us_per_token(tokenizer, args.requests, turns, args.repeats)
        print(f"HTTP: {turns} turns a wake-up, {cost:.2f} us a token")


if __name__ == "__main__":
    main()
