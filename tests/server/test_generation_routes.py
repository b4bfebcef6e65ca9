"""The generation endpoints' short way through the app (app.GenerationRoutes): a POST reaches its
handler inside the API-key check and past FastAPI's routing; other methods and paths still go
through FastAPI."""

from __future__ import annotations

import asyncio
import json

import pytest

pytest.importorskip("fastapi")

from ddtree.server.app import GenerationRoutes, ServerConfig, create_app  # noqa: E402
from ddtree.server.auth import KeyGate  # noqa: E402
from ddtree.server.engine_core import EngineCore  # noqa: E402


class _ClosedCore(EngineCore):
    """An engine core that refuses every submission as a stopping server does (no process)."""

    def __init__(self):
        super().__init__(None, None)
        self.facts = dict(has_drafter=False, max_budget=1, max_model_len=256, chat_template=False)
        self.submitted = 0

    def start(self) -> None:
        pass

    def stop(self, timeout_s: float = 30.0) -> None:
        pass

    def submit(self, job, loop):
        self.submitted += 1
        raise RuntimeError("the server is shutting down")


def _call(app, method: str, path: str, body: bytes = b"", headers=()) -> tuple[int, dict]:
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method, "path": path,
             "raw_path": path.encode(), "query_string": b"", "root_path": "", "scheme": "http",
             "server": ("127.0.0.1", 8000), "client": ("127.0.0.1", 5000),
             "headers": [(b"host", b"x"), (b"content-type", b"application/json"),
                         (b"content-length", str(len(body)).encode()), *headers]}
    delivered, sent = [], []

    async def receive():
        if not delivered:
            delivered.append(True)
            return {"type": "http.request", "body": body, "more_body": False}
        await asyncio.sleep(30)

    async def send(message):
        sent.append(message)

    asyncio.run(app(scope, receive, send))
    body_bytes = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return sent[0]["status"], json.loads(body_bytes) if body_bytes else {}


def test_a_generation_post_takes_the_short_way_inside_the_key_check():
    core = _ClosedCore()
    app = create_app(core, ServerConfig(model_name="m", default_mode="ar", api_keys=("k1",)))
    body = json.dumps({"model": "m", "prompt": "x", "max_tokens": 2}).encode()
    status, _ = _call(app, "POST", "/v1/completions", body)
    assert status == 401 and core.submitted == 0  # the key check still comes first
    status, error = _call(app, "POST", "/v1/completions", body, [(b"authorization", b"Bearer k1")])
    assert (status, error["error"]["code"], core.submitted) == (503, "shutting_down", 1)
    status, error = _call(app, "POST", "/v1/chat/completions", b'{"model": "m", "messages": 3}',
                          [(b"authorization", b"Bearer k1")])
    assert status == 400 and error["error"]["param"] == "messages"  # the body's checks are the handler's, as before
    status, error = _call(app, "GET", "/v1/completions", headers=[(b"authorization", b"Bearer k1")])
    assert status == 405 and error["error"]["code"] == "method_not_allowed"  # other methods: FastAPI's answer
    stack, layers = app.middleware_stack, []
    while stack is not None and len(layers) < 20:
        layers.append(type(stack))
        stack = getattr(stack, "app", None)
    assert layers.index(KeyGate) < layers.index(GenerationRoutes)  # the short way sits inside the key check
