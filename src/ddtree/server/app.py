"""The FastAPI application: OpenAI's /v1/completions, /v1/chat/completions and /v1/models, plus
/health and /metrics, over one Engine driven by the scheduler thread.

`create_app(engine, ServerConfig(...))` builds it over an Engine (a scheduler thread in this
process) or over an EngineCore (engine_core.py: the engine in a process of its own, as `ddtree
serve` runs it); the app's lifespan starts and stops either, so any ASGI server runs it.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from types import SimpleNamespace

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError
from starlette.exceptions import HTTPException

from .auth import KeyCheck, KeyGate
from .errors import APIError, internal_error, read_json, validation_error
from .handler import generate
from .jobs import Job
from .limits import Limits
from .metrics import Metrics
from .prompts import has_chat_template
from .protocol import ChatCompletionRequest, CompletionRequest, DDTreeOptions
from .engine_core import EngineCore
from .scheduler import Scheduler

log = logging.getLogger("ddtree.server")
COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


@dataclass
class ServerConfig:
    """model_name: the id clients name in `model`; default_mode / default_budget: for requests
    without `ddtree` extras; max_queue: accepted requests waiting for a slot before 503;
    max_body_bytes: request bodies over this are refused (413); metadata: shown by /health and
    /v1/models (device, GPU name, versions); api_keys: when any, /v1/* needs one as a bearer token
    (and /metrics too with metrics_need_key); limits: what one request may ask and how long it may
    take (limits.py)."""

    model_name: str = "ddtree"
    default_mode: str = "ddtree"
    default_budget: int | str = "auto"
    max_queue: int = 256
    max_body_bytes: int = 2 << 20
    retry_after_s: int = 1
    metadata: dict = field(default_factory=dict)
    api_keys: tuple[str, ...] = ()
    metrics_need_key: bool = False
    limits: Limits = field(default_factory=Limits)


def engine_facts(engine) -> dict:
    """What the HTTP side needs to know of an Engine (an EngineCore's core sends it)."""
    return dict(has_drafter=engine.drafter is not None, max_budget=engine.max_budget,
                max_model_len=engine.max_model_len, chat_template=has_chat_template(engine.tokenizer))


def create_app(engine, config: ServerConfig | None = None) -> FastAPI:
    """The ASGI app serving `engine`: an ddtree Engine (used by a scheduler thread only), or a
    launched EngineCore (its `facts` hold engine_facts' keys; its limits and queue are its own)."""
    config = config or ServerConfig()
    metrics = Metrics()
    if isinstance(engine, EngineCore):
        facts, scheduler = engine.facts, engine
        engine.metrics = metrics
    else:
        facts = engine_facts(engine)
        scheduler = Scheduler(engine, metrics, max_queue=config.max_queue, limits=config.limits)
    if config.default_mode != "ar" and not facts["has_drafter"]:
        raise ValueError(f"default mode {config.default_mode!r} needs a drafter; this engine has none (use ar)")
    budget = config.default_budget
    if budget != "auto" and (isinstance(budget, bool) or not isinstance(budget, int)
                             or not 1 <= budget <= facts["max_budget"]):
        raise ValueError(f'default budget must be "auto" or an int in [1, {facts["max_budget"]}], got {budget!r}')
    state = SimpleNamespace(
        config=config, metrics=metrics, scheduler=scheduler, streams=0, has_drafter=facts["has_drafter"],
        max_budget=facts["max_budget"], max_model_len=facts["max_model_len"], chat_template=facts["chat_template"],
        created=int(time.time()))

    @asynccontextmanager
    async def lifespan(_app):
        state.scheduler.start()
        try:
            yield
        finally:
            await asyncio.to_thread(state.scheduler.stop)

    app = FastAPI(title="ddtree", summary="OpenAI-compatible DDTree speculative decoding server",
                  lifespan=lifespan)
    app.state.ddtree = state

    @app.exception_handler(HTTPException)
    async def _http_error(_request, exc: HTTPException):  # 404 unknown route, 405 wrong method
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return APIError(exc.status_code, str(exc.detail), code=code, headers=dict(exc.headers or {})).response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_request, exc: RequestValidationError):
        return APIError(400, str(exc), code="invalid_value").response()

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception):
        log.error("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
        return APIError(500, "internal server error", code="internal_error").response()

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await _serve(request, state, "completion", CompletionRequest)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await _serve(request, state, "chat", ChatCompletionRequest)

    # added first, so inside the key check: a generation request pays the key check and no more framework
    app.add_middleware(GenerationRoutes, routes={"/v1/completions": completions,
                                                 "/v1/chat/completions": chat_completions})
    app.add_middleware(KeyGate, check=KeyCheck(config.api_keys),
                       guarded=lambda path: path.startswith("/v1/") or (config.metrics_need_key and path == "/metrics"),
                       on_refused=lambda path: metrics.count_request(path, "401"))

    @app.get("/v1/models")
    async def models():
        card = {"id": config.model_name, "object": "model", "created": state.created, "owned_by": "ddtree",
                "max_model_len": state.max_model_len, "ddtree": _info(state)}
        return {"object": "list", "data": [card]}

    @app.get("/health")
    async def health():
        ok = state.scheduler.alive
        status = "unavailable" if not ok else "draining" if state.scheduler.draining else "ok"
        body = {"status": status, "model": config.model_name, **state.scheduler.snapshot, **_info(state)}
        return JSONResponse(body, status_code=200 if status == "ok" else 503)

    @app.get("/metrics")
    async def prometheus():
        if getattr(state.scheduler, "api_servers", 1) > 1:  # the core keeps the one registry of all of them
            try:
                return Response(await state.scheduler.scrape(), media_type=metrics.content_type)
            except RuntimeError as err:
                return APIError(503, str(err), code="engine_dead").response()
        return Response(metrics.render(), media_type=metrics.content_type)

    return app


class GenerationRoutes:
    """ASGI middleware: a POST to a generation endpoint goes straight to its handler, past FastAPI's
    routing and its per-request dependency solving (about half of the framework's time of such a
    request on this project's CPU, on every request's path to its first token). The same
    endpoints stay registered with FastAPI for everything else (another method's 405, the docs).
    The handlers catch their own errors; anything else reaches the outer error middleware (500)."""

    def __init__(self, app, routes: dict):
        self.app, self.routes = app, routes

    async def __call__(self, scope, receive, send):
        endpoint = self.routes.get(scope["path"]) if scope["type"] == "http" and scope["method"] == "POST" else None
        if endpoint is None:
            return await self.app(scope, receive, send)
        response = await endpoint(Request(scope, receive, send))
        await response(scope, receive, send)


def _info(state) -> dict:
    config = state.config
    modes = ["ar", "chain", "ddtree"] if state.has_drafter else ["ar"]
    return {"modes": modes, "default_mode": config.default_mode, "default_budget": config.default_budget,
            "max_budget": state.max_budget, "chat_template": state.chat_template, **config.metadata}


async def _serve(request: Request, state, kind: str, model):
    """Parse and check one generation request, then hand it to `generate`."""
    prefix = "chatcmpl" if kind == "chat" else "cmpl"
    request_id = f"{prefix}-{uuid.uuid4().hex}"
    try:
        try:
            raw = await read_json(request, state.config.max_body_bytes, state.config.limits.body_timeout_s)
            body = model.model_validate(raw)
        except ValidationError as err:
            raise validation_error(err) from None
        job = _job(state, request_id, kind, body)
    except APIError as err:
        state.metrics.count_request(request.url.path, str(err.status))
        return err.response()
    except Exception:
        log.exception("request %s: failed while parsing", request_id)
        state.metrics.count_request(request.url.path, "500")
        return internal_error(request_id).response()
    return await generate(request, state, job, kind, bool(body.stream), body.stream_options)


def _job(state, request_id: str, kind: str, body) -> Job:
    """The engine job for a validated body; raises APIError for what the body may not ask."""
    config = state.config
    refused = body.unsupported()
    if refused is not None:
        raise refused
    if body.model is not None and body.model != config.model_name:
        raise APIError(404, f"the model '{body.model}' does not exist; this server serves '{config.model_name}'",
                       param="model", code="model_not_found")
    options = body.ddtree or DDTreeOptions()
    mode = options.mode or config.default_mode
    if mode != "ar" and not state.has_drafter:
        raise APIError(400, f"mode '{mode}' needs a drafter; this server has none (use 'ar')", param="ddtree.mode",
                       code="invalid_value")
    budget = options.budget if options.budget is not None else config.default_budget
    if budget != "auto" and budget > state.max_budget:
        raise APIError(400, f"budget {budget} is over this server's max_budget={state.max_budget}",
                       param="ddtree.budget", code="invalid_value")
    sampling = {"temperature": 1.0 if body.temperature is None else body.temperature,  # OpenAI's defaults
                "top_p": 1.0 if body.top_p is None else body.top_p, "top_k": max(body.top_k or 0, 0),
                "seed": body.seed, "stop": body.stops(), "ignore_eos": body.ignore_eos}
    if kind == "chat":
        if not state.chat_template:
            raise APIError(400, "this model's tokenizer has no chat template (no chat_template in its "
                           "tokenizer_config.json): use /v1/completions", param="messages",
                           code="chat_template_missing")
        limit_param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        max_tokens = config.limits.max_tokens_for(body.limit(), limit_param)
        return Job(request_id, None, [m.as_dict() for m in body.messages], max_tokens, sampling, mode, budget,
                   limit_param)
    max_tokens = COMPLETION_DEFAULT_MAX_TOKENS if body.max_tokens is None else body.max_tokens
    return Job(request_id, body.prompt, None, config.limits.max_tokens_for(max_tokens, "max_tokens"), sampling, mode,
               budget)
