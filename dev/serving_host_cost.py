"""Host throughput of `ddtree serve`'s serving path with the device work left out: the demo pair's
engine in a real engine-core process on the CPU, its rounds and prefills canned (each step commits
one token per request, as `ar` does, with no model compute), this process as the HTTP process
(the app on uvicorn), and streamed clients in processes (benchmarks/client_pool.py). So what limits
the tokens/s here is the host's work per token across the core, the HTTP process and the clients:
compare commits on one machine, in one run of each.

    python dev/serving_host_cost.py --concurrency 8 32 64 --max-tokens 128 [--step-ms 0.5]
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import threading
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from client_pool import ClientPool, ServerCpu  # noqa: E402

TOKEN = 7  # what every canned step commits


def build(max_batch: int, step_s: float = 0.0):
    """The demo pair's engine on the CPU, its device work canned (run in the core process); each
    round sleeps step_s (the device's time, the interpreter lock released)."""
    from ddtree import Engine
    from ddtree.engine.round import result_width

    engine = Engine.from_pretrained(device="cpu", max_batch=max_batch, kept_costs="off")

    def round_(table, plan, timer=None):
        width = result_width(engine.max_depth, engine.moe_layers if plan.experts else 0, plan.paths)
        result = torch.full((plan.bucket, width), -1, dtype=torch.int64)
        result[:, 0], result[:, 1] = 1, TOKEN
        if step_s:
            time.sleep(step_s)
        return result

    engine.worker.round = round_
    engine.worker.prefill = lambda table, slots, prompts, sampled, filtered: torch.full((len(slots),), TOKEN)
    return engine


def serve(app) -> tuple[str, object]:
    """uvicorn serving `app` from a thread on a free loopback port: (url, server)."""
    import uvicorn

    from ddtree.server.listening import listen

    (sock,) = listen("127.0.0.1", 0)  # as serve binds: TCP_NODELAY on what it accepts
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True).start()
    while not server.started:
        time.sleep(0.02)
    return f"http://127.0.0.1:{sock.getsockname()[1]}", server


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[8, 32, 64])
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--requests", type=int, default=None, help="requests per cell (default 2 c)")
    parser.add_argument("--client-processes", type=int, default=2)
    parser.add_argument("--step-ms", type=float, default=0.0,
                        help="each canned round's sleep: the device time of a step (0: as fast as the host goes)")
    args = parser.parse_args()
    from ddtree.server.app import ServerConfig, create_app, engine_facts
    from ddtree.server.engine_core import EngineCore

    core = EngineCore(functools.partial(build, max(args.concurrency), args.step_ms / 1e3), engine_facts, max_queue=1 << 16)
    core.launch()
    url, server = serve(create_app(core, ServerConfig(model_name="demo", default_mode="ar")))
    body = dict(model="demo", prompt="def f(x):", max_tokens=args.max_tokens, temperature=0.0, stream=True,
                ignore_eos=True, ddtree={"mode": "ar"},
                stream_options={"include_usage": True, "continuous_usage_stats": True})  # as serve_bench sends
    cpu = ServerCpu(os.getpid(), core.pid)  # the client processes are this process's children too
    try:
        with ClientPool(args.client_processes) as clients:
            clients.run(url, [body] * 4, 2)  # warm-up
            for c in args.concurrency:
                cpu.start()
                records, wall, client_cpu = clients.run(url, [body] * (args.requests or 2 * c), c)
                shares = {k: round(v, 2) for k, v in cpu.fractions(wall).items()}
                ok = [r for r in records if r["error"] is None and r["ttft"] is not None]
                ttft = sorted(r["ttft"] for r in ok)[len(ok) // 2] * 1e3 if ok else float("nan")
                print(f"c={c:3d}: {sum(r['tokens'] for r in ok) / wall:9.1f} tokens/s, TTFT p50 {ttft:.1f} ms, "
                      f"{len(records) - len(ok)} errors, CPU {shares} client {client_cpu:.2f}", flush=True)
    finally:
        server.should_exit = True
        core.stop()


if __name__ == "__main__":
    main()
