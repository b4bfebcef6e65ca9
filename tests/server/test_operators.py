"""What an operator sets: API keys (401 without one, constant-time compare, never logged),
per-request limits, the stream cap, request / body / send deadlines, all on a real server."""

import asyncio
import logging
import socket
import threading
import time

import httpx
import pytest

from ddtree.server.auth import KeyCheck, api_keys
from ddtree.server.handler import _ClosingStream
from ddtree.server.limits import Limits

from .conftest import start_server
from .harness import metric, sse_events

openai = pytest.importorskip("openai")

KEYS = ("sk-first-key", "sk-second-key")


def test_api_keys_from_flags_and_the_environment():
    assert api_keys(["a"], {"DDTREE_API_KEY": " b, c,,"}) == ("a", "b", "c")
    assert api_keys(None, {}) == ()
    for bad in ([""], ["two words"]):
        with pytest.raises(ValueError, match="an API key must be non-empty"):
            api_keys(bad, {})
    check = KeyCheck(KEYS)
    assert check.allows(b"Bearer sk-second-key") and check.allows(b"bearer  sk-first-key")
    assert not any(check.allows(h) for h in (None, b"", b"Bearer", b"sk-first-key", b"Basic sk-first-key",
                                              b"Bearer sk-first-key2", b"Bearer sk-first-ke"))
    assert KeyCheck(()).allows(None)


def test_keyed_server_refuses_without_a_key_and_never_logs_it(pairs, caplog):
    caplog.set_level(logging.DEBUG)
    with start_server(pairs, api_keys=KEYS, metrics_need_key=True, max_batch=2) as live:
        body = {"prompt": "def f(", "max_tokens": 4, "temperature": 0}
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sk-first-key"}):
            r = httpx.post(f"{live.url}/v1/completions", json=body, headers=headers, timeout=30)
            assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
            assert r.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(f"{live.url}/v1/models", timeout=5).status_code == 401
        assert httpx.get(f"{live.url}/metrics", timeout=5).status_code == 401
        assert httpx.get(f"{live.url}/health", timeout=5).status_code == 200  # probes need no key
        client = openai.OpenAI(base_url=f"{live.url}/v1", api_key=KEYS[1])
        assert client.completions.create(model="tiny", prompt="def f(", max_tokens=4, temperature=0).usage
        keyed = {"Authorization": f"Bearer {KEYS[0]}"}
        assert httpx.get(f"{live.url}/metrics", headers=keyed, timeout=5).status_code == 200
        refused = httpx.get(f"{live.url}/metrics", headers=keyed, timeout=5).text
        assert 'ddtree_requests_total{endpoint="/v1/completions",status="401"} 3.0' in refused
    assert not any(key in record.getMessage() for key in KEYS for record in caplog.records)


def test_request_size_limits(pairs):
    limits = Limits(max_tokens=6, max_prompt_tokens=24)
    with start_server(pairs, limits=limits, max_batch=2) as live:
        r = httpx.post(f"{live.url}/v1/completions", json={"prompt": "ab", "max_tokens": 7}, timeout=30)
        err = r.json()["error"]
        assert r.status_code == 400 and err["param"] == "max_tokens" and "--max-tokens-limit" in err["message"]
        r = httpx.post(f"{live.url}/v1/completions", json={"prompt": "x" * 25, "max_tokens": 2}, timeout=30)
        err = r.json()["error"]
        assert r.status_code == 400 and err["code"] == "context_length_exceeded" and "--max-prompt-tokens" in err["message"]
        chat = {"messages": [{"role": "user", "content": "hi"}], "temperature": 0, "ignore_eos": True}
        r = httpx.post(f"{live.url}/v1/chat/completions", json=chat, timeout=30)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 6  # capped, not refused
        r = httpx.post(f"{live.url}/v1/completions", json={"prompt": "x" * 24, "max_tokens": 6}, timeout=30)
        assert r.status_code == 200
        assert live.wait_idle()["pages_free"] == live.wait_idle()["pages_total"]


def test_stream_cap_answers_429_until_a_stream_closes(pairs):
    with start_server(pairs, limits=Limits(max_streams=1), max_batch=1) as live:
        hog = {"prompt": "ab", "max_tokens": 200, "temperature": 0, "ignore_eos": True, "ddtree": {"mode": "ar"}}
        first = threading.Thread(target=httpx.post, args=(f"{live.url}/v1/completions",),
                                 kwargs={"json": hog, "timeout": 60})
        first.start()  # holds the only batch slot for a while
        time.sleep(0.3)
        stream = {"prompt": "cd", "max_tokens": 4, "temperature": 0, "stream": True}
        with httpx.stream("POST", f"{live.url}/v1/completions", json=stream, timeout=60) as queued:
            assert queued.status_code == 200  # accepted, waiting for the slot: it counts as open
            second = httpx.post(f"{live.url}/v1/completions", json=stream, timeout=30)
            assert second.status_code == 429 and second.headers["retry-after"] == "1"
            assert second.json()["error"]["code"] == "too_many_streams"
            assert sse_events(queued.iter_lines())[-1] == "[DONE]"
        first.join(60)
        again = httpx.post(f"{live.url}/v1/completions", json=stream, timeout=30)
        assert again.status_code == 200 and sse_events(again.text.splitlines())[-1] == "[DONE]"
        assert metric(live.url, "ddtree_requests_total", endpoint="/v1/completions", status="429") == 1


def test_request_deadline_stops_requests_and_frees_their_pages(pairs):
    with start_server(pairs, limits=Limits(request_timeout_s=0.3), max_batch=2) as live:
        long = {"prompt": "ab", "max_tokens": 200, "temperature": 0, "ignore_eos": True, "ddtree": {"mode": "ar"}}
        r = httpx.post(f"{live.url}/v1/completions", json=long, timeout=60)
        assert r.status_code == 504 and r.json()["error"]["code"] == "request_timeout"
        with httpx.stream("POST", f"{live.url}/v1/completions", json={**long, "stream": True}, timeout=60) as s:
            events = sse_events(s.iter_lines())
        assert events[-2]["error"]["code"] == "request_timeout" and events[-1] == "[DONE]"
        health = live.wait_idle()
        assert (health["running"], health["pages_free"]) == (0, health["pages_total"])
        short = httpx.post(f"{live.url}/v1/completions", json={"prompt": "ab", "max_tokens": 3}, timeout=30)
        assert short.status_code == 200


def test_a_slow_body_times_out_without_holding_up_others(pairs):
    with start_server(pairs, limits=Limits(body_timeout_s=0.5), max_batch=2) as live:
        host, port = live.url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port))) as slow:
            slow.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 100\r\n\r\n{\"prompt\": ")
            start = time.monotonic()
            r = httpx.post(f"{live.url}/v1/completions", json={"prompt": "ab", "max_tokens": 3}, timeout=30)
            assert r.status_code == 200 and time.monotonic() - start < 5
            slow.settimeout(10)
            answer = b""
            while b"request_timeout" not in answer:  # the headers and the body may come apart
                chunk = slow.recv(4096)
                if not chunk:
                    break
                answer += chunk
            answer = answer.decode()
        assert answer.startswith("HTTP/1.1 408") and "request_timeout" in answer


def test_a_stream_whose_client_reads_nothing_is_closed():
    """send never completes (the client's buffers are full): the response ends and on_close runs."""
    closed = []

    async def body():
        yield "data: 1\n\n"

    async def send(message):
        if message["type"] == "http.response.body":
            await asyncio.sleep(3600)

    async def receive():
        await asyncio.sleep(3600)

    response = _ClosingStream(body(), lambda: closed.append(True), 0.05, media_type="text/event-stream")
    scope = {"type": "http", "asgi": {"spec_version": "2.4"}}
    with pytest.raises(Exception):
        asyncio.run(asyncio.wait_for(response(scope, receive, send), 10))
    assert closed == [True]
