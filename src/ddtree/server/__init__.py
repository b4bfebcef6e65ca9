"""`ddtree serve`: an OpenAI-compatible HTTP server over the Engine, with continuous batching.

    command.py    the `serve` subcommand: arguments, engine loading, the processes
    running.py    one HTTP process's serving: the app under uvicorn until it stops or drains
    api_servers.py  --api-server-count: the other HTTP processes, started and watched by the first
    engine_core.py  an HTTP process's end of the engine-core process (receiver.py: its reading half)
    core_process.py the engine-core process; frontends.py: its sockets to the HTTP processes
    app.py        the FastAPI app: routes, ServerConfig, create_app(engine, config)
    protocol.py   request bodies (pydantic, strict, unknown fields refused)
    handler.py    one generation request over HTTP: submit, stream or collect, disconnects
    scheduler.py  the thread that owns the Engine: admission between rounds, aborts, failures
    prompts.py    tokenization, chat templates, context and cache limits (scheduler thread)
    jobs.py       what passes between the HTTP side and the scheduler: Job, events, Handle
    responses.py  OpenAI response bodies and server-sent events
    errors.py     OpenAI-style error bodies and the body reader (size, UTF-8, JSON)
    metrics.py    Prometheus metrics (prometheus-client)

This package imports FastAPI only from app.py and below; `command` is light.
"""

from .command import add_serve_command, serve

__all__ = ["add_serve_command", "serve"]
