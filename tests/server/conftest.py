"""Fixtures of the server tests: the tiny pair, a reference engine (requests served alone), and
one live server shared by the tests of a session (its state is checked back to idle after each)."""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("transformers")

from ddtree import Engine  # noqa: E402
from ddtree.server.app import ServerConfig, create_app  # noqa: E402

from .harness import LiveServer, make_pairs  # noqa: E402

ENGINE_ARGS = dict(device="cpu", page_size=8, max_model_len=256, max_budget=16)
BODY_LIMIT = 64 << 10


@pytest.fixture(scope="session")
def pairs(tmp_path_factory):
    return make_pairs(tmp_path_factory.mktemp("server_pair"))


@pytest.fixture(scope="session")
def reference(pairs):
    """An engine of its own: what a request gives when served alone."""
    return Engine.from_pretrained(pairs["target_chat"], pairs["drafter"], max_batch=1, **ENGINE_ARGS)


def start_server(pairs, target: str = "target_chat", max_batch: int = 8, **config) -> LiveServer:
    engine = Engine.from_pretrained(pairs[target], pairs["drafter"], max_batch=max_batch, **ENGINE_ARGS)
    settings = dict(model_name="tiny", default_mode="ddtree", default_budget=8, max_queue=64,
                    max_body_bytes=BODY_LIMIT)
    return LiveServer(create_app(engine, ServerConfig(**{**settings, **config})))


@pytest.fixture(scope="session")
def server(pairs):
    with start_server(pairs) as live:
        yield live


@pytest.fixture
def idle_server(server):
    """The shared server, asserted idle with every KV page free after the test."""
    yield server
    health = server.wait_idle()
    assert (health["running"], health["queued"], health["pages_free"]) == (0, 0, health["pages_total"]), health
