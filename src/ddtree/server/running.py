"""Serving the app until it stops: one API-server process's part of `ddtree serve` (command.py
starts the first, api_servers.py the others), and the limits serve's arguments set.
"""

from __future__ import annotations

import logging
import signal
import sys
from pathlib import Path

from .listening import urls


def serving_limits(args):
    """The operators' limits serve's arguments set (limits.Limits)."""
    from .limits import Limits

    return Limits(max_tokens=args.max_tokens_limit, max_prompt_tokens=args.max_prompt_tokens,
                  max_streams=args.max_streams, request_timeout_s=args.request_timeout,
                  body_timeout_s=args.body_timeout, send_timeout_s=args.send_timeout)


def run_app(sockets, args, keys, limits, engine, facts, announce: bool = True, peers=None, ending=None) -> int:
    """Serve the app over `engine` (an Engine, or an EngineCore launched or attached) on `sockets`
    until stopped; the exit code. announce: print the start-up and error lines (API server 0);
    peers: the other API servers (api_servers.ApiServers), passed SIGTERM and waited for; ending:
    a threading.Event that, once set, ends the server as SIGTERM does (set before it serves too)."""
    import uvicorn

    from ..engine.heap import frozen_heap
    from .app import ServerConfig, create_app
    from .shutdown import DrainingServer

    name = args.served_model_name or (Path(args.target).resolve().name if args.target else "ddtree-demo")
    config = ServerConfig(model_name=name, default_mode=args.mode, default_budget=args.budget,
                          max_queue=args.max_queue, max_body_bytes=args.max_body_bytes, metadata=facts["metadata"],
                          api_keys=keys, metrics_need_key=args.protect_metrics, limits=limits)
    if "api_servers" in facts:
        config.metadata = {**config.metadata, "api_servers": facts["api_servers"], "api_server": facts["api_server"]}
    app = create_app(engine, config)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s:     %(name)s: %(message)s")
    if announce:
        processes = "" if args.single_process else f", engine process {engine.pid}"
        if peers is not None:
            processes += f", {peers.count} API server processes"
        print(f"ddtree serve: {name} on {facts['metadata']['device_name']} ({facts['device']}), modes "
              f"{'ar, chain, ddtree' if facts['has_drafter'] else 'ar'}, max_batch {facts['max_batch']}, "
              f"{facts['num_pages']} KV pages, {len(keys) or 'no'} API key{'' if len(keys) == 1 else 's'}"
              f"{processes}; {urls(sockets)}", file=sys.stderr, flush=True)
    uv = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level, timeout_graceful_shutdown=5)
    scheduler = app.state.ddtree.scheduler
    if args.single_process:  # a lost tensor-parallel rank ends the server as a dead core does
        scheduler.on_fatal = exit_on_signal
    # an attached API server obeys server 0's SIGTERM only (a terminal's SIGINT reaches every process)
    signals = None if announce else (signal.SIGTERM,)
    with frozen_heap():  # the app, and with --single-process the engine, out of the collections serving triggers
        server = DrainingServer(uv, scheduler, args.drain_seconds, peers=peers, signals=signals, ending=ending)
        server.run(sockets=sockets)
    died = getattr(engine, "died", None) or getattr(scheduler, "fatal", None)
    if died:
        if announce:
            print(f"ddtree serve: error: {died}", file=sys.stderr, flush=True)
        return 1
    return 0


def exit_on_signal() -> None:
    """The engine process died (or, in one process, lost a rank): shut the server down as SIGTERM
    would (its requests have failed)."""
    import os

    os.kill(os.getpid(), signal.SIGTERM)
