"""`ddtree serve`: its arguments, and the start-up (load the engine, build the app, run uvicorn).

FastAPI and uvicorn are imported only when the command runs, so `ddtree generate` does not pay
for them.
"""

from __future__ import annotations

import argparse
import platform
import sys
import threading
import time

from ..arguments import (UsageError, add_pair_arguments, budget, cache_line, load_engine, positive,
                         serving_batch, warm_modes, weights_line)
from .auth import ENV_VAR, api_keys
from .listening import listen

_positive_int = positive(int)


def _port(text: str) -> int:
    value = int(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be in [0, 65535], got {text}")
    return value


_port.__name__ = "int"  # argparse names the type in its error


def add_serve_command(commands) -> argparse.ArgumentParser:
    """Add the `serve` subparser to ddtree's subcommands (argparse's _SubParsersAction)."""
    p = commands.add_parser("serve", help="an OpenAI-compatible HTTP server with continuous batching and streaming")
    add_pair_arguments(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    p.add_argument("--port", type=_port, default=8000, help="0: any free port")
    p.add_argument("--mode", choices=("ar", "chain", "ddtree"), default="ddtree",
                   help="default decoding mode (a request may pick its own with ddtree: {mode})")
    p.add_argument("--budget", type=budget, default="auto", help="default tree budget (ddtree: {budget}): "
                   "auto (each round's size chosen by measured cost) or nodes per round")
    p.add_argument("--round-costs", default=None, help="a round-cost table from `ddtree profile` (default: "
                   "the one kept from an earlier run for this pair and device, with what it lacks measured at "
                   "start-up, before the server is ready, and kept)")
    p.add_argument("--fresh-costs", action="store_true", help="measure the round costs again, not the kept table")
    p.add_argument("--warm-modes", type=warm_modes, default=None,
                   help="comma-separated modes whose round graphs are captured at start-up, at every batch bucket "
                        "and sampling setting (ar, chain, ddtree:auto, ddtree:N; none: nothing); a request of another "
                        "fixed budget captures on its first rounds (default: ar, and with a drafter chain and ddtree "
                        "at --budget)")
    p.add_argument("--max-queue", type=_positive_int, default=256,
                   help="requests waiting for a batch slot before new ones get 503 + Retry-After")
    p.add_argument("--max-body-bytes", type=_positive_int, default=2 << 20, help="larger request bodies get 413")
    p.add_argument("--served-model-name", default=None, help="the model id of /v1/models (default: the target "
                   "directory's name, ddtree-demo for the demo pair)")
    p.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"))
    ops = p.add_argument_group("operators' limits")
    ops.add_argument("--api-key", action="append", default=None,
                     help=f"a key /v1/* requests must send as 'Authorization: Bearer <key>' (repeatable; "
                          f"${ENV_VAR} holds more, comma-separated, out of process lists)")
    ops.add_argument("--protect-metrics", action="store_true", help="/metrics needs a key too (/health never does)")
    ops.add_argument("--max-tokens-limit", type=_positive_int, default=None,
                     help="the most tokens one request may ask for (more: 400; asking nothing: this many)")
    ops.add_argument("--max-prompt-tokens", type=_positive_int, default=None, help="longer prompts get 400")
    ops.add_argument("--max-streams", type=_positive_int, default=None,
                     help="streamed responses open at once (more: 429 + Retry-After)")
    ops.add_argument("--request-timeout", type=positive(float), default=None,
                     help="seconds from acceptance to the last token; then the request is stopped (504)")
    ops.add_argument("--body-timeout", type=positive(float), default=30.0,
                     help="seconds to receive a request body (408 after)")
    ops.add_argument("--send-timeout", type=positive(float), default=30.0,
                     help="a stream whose client reads nothing this long is aborted")
    ops.add_argument("--drain-seconds", type=positive(float), default=30.0,
                     help="on SIGTERM / SIGINT: how long running requests may finish before they are failed")
    ops.add_argument("--api-server-count", type=_positive_int, default=1,
                     help="HTTP processes sharing the port over one engine process (as vLLM's; at many streams one "
                          "process's decoding and formatting is the bottleneck); each takes 1/N of --max-queue and "
                          "--max-streams")
    ops.add_argument("--single-process", action="store_true",
                     help="run the engine in the HTTP server's process (a scheduler thread) instead of a process "
                          "of its own")
    return p


def _metadata(engine, dtype) -> dict:
    """What /health and /v1/models report about the serving machine (benchmarks record it)."""
    import torch

    import ddtree

    device = engine.device
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else (platform.processor() or "cpu")
    versions = {"ddtree": getattr(ddtree, "__version__", None), "torch": torch.__version__,
                "python": platform.python_version()}
    for module in ("transformers", "triton", "fastapi", "uvicorn"):
        try:
            versions[module] = __import__(module).__version__
        except Exception:  # absent on this machine (triton on macOS)
            versions[module] = None
    blocks = engine.blocks
    return {"device": str(device), "gpu": name if device.type == "cuda" else None, "device_name": name,
            "dtype": str(dtype).removeprefix("torch."), "max_batch": engine.max_batch, "page_size": engine.page_size,
            "num_pages": blocks.num_pages, "cpu_threads": torch.get_num_threads(), "versions": versions}


def leave_a_core_to_the_server(device) -> None:
    """On the CPU, torch's intra-op threads take one core less than the process may use, unless
    OMP_NUM_THREADS says otherwise: the event loop and the scheduler thread need a core of their
    own (measured: docs/notes/server.md)."""
    import os

    import torch

    if device.type != "cpu" or os.environ.get("OMP_NUM_THREADS"):
        return
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    torch.set_num_threads(max(1, cores - 1))


def serve(args) -> int:
    """Run the server until interrupted; returns the exit code. Errors loading the checkpoints
    propagate (ddtree's main prints them as one line). ddtree's main has checked --target /
    --drafter / --mode."""
    if args.target is None:
        from ..demo import demo_pair

        demo_pair()  # FileNotFoundError with one clear line before anything heavy loads
    keys = api_keys(args.api_key)  # before the model loads: a bad key is a one-line error at once
    sockets = listen(args.host, args.port)
    try:
        return _serve_on(sockets, args, keys)
    finally:  # uvicorn closes them when it shuts down; an error before it runs must too
        for sock in sockets:
            sock.close()


def load_for_serving(args):
    """The engine serve runs (in the engine-core process unless --single-process), with its round
    costs for budget auto ready (kept, loaded or measured) and the round graphs of --warm-modes
    captured before any request waits for them."""
    from ..engine.loading import resolve_device
    from ..engine.prefill_graphs import capture_prefill_graphs

    # before the engine is built: its round costs (kept or measured) are for the threads it serves with
    leave_a_core_to_the_server(resolve_device(args.device))
    engine = load_engine(args, round_costs=args.round_costs, kept_costs="fresh" if args.fresh_costs else "use")
    print(f"ddtree serve: {cache_line(engine)}", file=sys.stderr, flush=True)
    print(f"ddtree serve: {weights_line(engine)}", file=sys.stderr, flush=True)
    start = time.perf_counter()
    buckets = capture_prefill_graphs(engine)  # an admission's prefill never captures on the request path
    if buckets:
        print(f"ddtree serve: prefill graphs of prompts up to {buckets[-1]} rows (buckets {buckets}) captured in "
              f"{time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)
    if engine.sizer is not None:
        measure_for_auto(engine)
    from ..engine.warming import capture_mode_graphs, default_warm_modes

    modes = args.warm_modes
    if modes is None:
        modes = default_warm_modes(args.budget, engine.sizer is not None)
    start = time.perf_counter()
    buckets = capture_mode_graphs(engine, modes, progress=True)
    if buckets:
        names = ", ".join(mode if budget is None else f"{mode}:{budget}" for mode, budget in modes)
        print(f"ddtree serve: round graphs of {names} at batch buckets {buckets} (greedy, sampled, sampled with a "
              f"cut) captured in {time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)
    return engine


def measure_for_auto(engine) -> None:
    """Budget auto's round costs at start-up: kept, loaded or measured (its greedy graphs with them)."""
    from ..engine.kept_costs import table_path

    start = time.perf_counter()
    missing = engine.unmeasured_buckets()
    if missing:
        print(f"ddtree serve: measuring round costs for budget auto at batch buckets {missing} x tree sizes "
              f"{list(engine.sizer.sizes)} before serving (once per pair and device: the table is kept; "
              f"a smaller --max-batch measures fewer buckets; --round-costs FILE skips it)",
              file=sys.stderr, flush=True)
    try:
        engine.measure_round_costs(progress=True)
        kept = table_path(engine.signature) if engine.kept_costs != "off" else None
        print(f"ddtree serve: round costs for batches up to {engine.max_batch} ready in "
              f"{time.perf_counter() - start:.1f} s" + (f" (kept in {kept})" if kept else ""),
              file=sys.stderr, flush=True)
    except (ValueError, RuntimeError) as err:  # fixed budgets and ar work without them
        engine.sizer.failure = str(err)
        print(f"ddtree serve: warning: round costs could not be measured ({err}); budget auto takes the "
              "smallest tree (a fixed --budget, or --round-costs from ddtree profile, avoids it)",
              file=sys.stderr, flush=True)


def serving_facts(engine) -> dict:
    """engine_facts and what serve's start-up line and /health report of the engine."""
    from .app import engine_facts

    return {**engine_facts(engine), "metadata": _metadata(engine, engine.target.embed_tokens.weight.dtype),
            "device": str(engine.device), "max_batch": engine.max_batch, "num_pages": engine.blocks.num_pages}


def _serve_on(sockets, args, keys) -> int:
    """serve's part after the sockets are taken: load (in the engine-core process), then serve (with
    --api-server-count N, beside N - 1 more HTTP processes: api_servers.py)."""
    import functools

    from .api_servers import ApiServers, share, shared_limits
    from .engine_core import EngineCore
    from .running import exit_on_signal, run_app, serving_limits

    count = args.api_server_count
    if count > 1 and args.single_process:
        raise UsageError("--api-server-count needs the engine in a process of its own (drop --single-process)")
    for flag, value in (("--max-queue", args.max_queue), ("--max-streams", args.max_streams)):
        if count > 1 and value is not None and value < count:
            raise UsageError(f"{flag} {value} is less than --api-server-count {count}: each API server takes an "
                             "equal share of it, at least 1")
    limits = shared_limits(serving_limits(args), count)
    args.max_batch = args.max_batch or serving_batch(args.device)
    peers, ending = None, threading.Event()  # ending: end the server as SIGTERM would, once it serves
    if args.single_process:
        engine = load_for_serving(args)
        facts = serving_facts(engine)
    else:
        engine = EngineCore(functools.partial(load_for_serving, args), serving_facts,
                            max_queue=share(args.max_queue, count), limits=limits, api_servers=count)
        facts = engine.launch()
        engine.on_death = lambda: None if engine.draining else exit_on_signal()  # a drain ends by itself
    code = 1
    try:
        if count > 1:
            peers = ApiServers(count, sockets, args, keys, engine.directory)
            peers.detach, peers.end_server = engine.detach, ending.set
            engine.on_death = lambda: (peers.core_died(engine.died), None if engine.draining else ending.set())
            peers.start()
        code = run_app(sockets, args, keys, limits, engine, facts, peers=peers, ending=ending)
    finally:  # every way out (a forced exit skips the app's shutdown, an error before it runs): no core left
        if peers is not None:
            peers.stop(timeout_s=5)
        if not args.single_process:
            engine.stop(timeout_s=5)
    if peers is not None and peers.failed is not None and code == 0:  # an API server that ended on its own
        print(f"ddtree serve: error: {peers.failed}", file=sys.stderr, flush=True)
        code = 1
    return code
