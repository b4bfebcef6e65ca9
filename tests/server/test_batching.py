"""Continuous batching over HTTP: parallel requests equal to each served alone, clients that
disconnect (streamed and not) aborted with their pages freed, the bounded queue (503 +
Retry-After), and a bounded load test that ends with every page free."""

import asyncio
import json
import time

import httpx
import pytest

from .conftest import start_server
from .harness import metric, sse_events
from .test_api import served_alone

PROMPTS = ["def add(a, b):", "for i in range(", "x = {", "import sys\n", "class Tree:", "print('", "while True:",
           "return [", "# sum of", "async def f():", "if x > 0:", "y = lambda z:"]


def _case(i: int) -> dict:
    mode = ("ar", "chain", "ddtree")[i % 3]
    sampled = i % 2 == 1
    return {"prompt": PROMPTS[i], "max_tokens": 8 + 2 * (i % 5), "temperature": 0.9 if sampled else 0.0,
            "seed": 100 + i if sampled else None, "stream": i % 4 < 2,
            "ddtree": {"mode": mode, "budget": (4, 8, 16)[i % 3]}}


async def _send(client: httpx.AsyncClient, url: str, body: dict) -> tuple[int, str, dict]:
    """(status, text, usage) of one completion, streamed or not."""
    if not body.get("stream"):
        r = await client.post(f"{url}/v1/completions", json=body)
        out = r.json()
        if r.status_code != 200:
            return r.status_code, "", out
        return 200, out["choices"][0]["text"], out["usage"]
    body = {**body, "stream_options": {"include_usage": True}}
    async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        if r.status_code != 200:
            return r.status_code, "", (await r.aread()).decode()
        events = sse_events([line async for line in r.aiter_lines()])
    assert events[-1] == "[DONE]", events[-3:]
    return 200, "".join(e["choices"][0]["text"] for e in events[:-2]), events[-2]["usage"]


async def _all(url: str, bodies: list[dict], concurrency: int) -> list:
    limit = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=httpx.Timeout(120.0)) as client:
        async def one(body):
            async with limit:
                return await _send(client, url, body)
        return await asyncio.gather(*(one(b) for b in bodies))


def test_parallel_requests_equal_each_served_alone(idle_server, reference):
    steps = metric(idle_server.url, "ddtree_round_seconds_count")
    bodies = [_case(i) for i in range(len(PROMPTS))]
    results = asyncio.run(_all(idle_server.url, bodies, concurrency=len(bodies)))
    for body, (status, text, usage) in zip(bodies, results):
        alone = served_alone(reference, body["prompt"], body["max_tokens"], mode=body["ddtree"]["mode"],
                             budget=body["ddtree"]["budget"], temperature=body["temperature"], seed=body["seed"])
        assert status == 200
        assert (text, usage["completion_tokens"]) == (alone.text, len(alone.token_ids)), body
        assert usage["ddtree"]["rounds"] == alone.stats.rounds
    # They shared rounds: fewer engine steps than the requests' rounds added up.
    taken = metric(idle_server.url, "ddtree_round_seconds_count") - steps
    assert taken < sum(u["ddtree"]["rounds"] for _, _, u in results) / 2


def _counts(url: str) -> tuple[float, float]:
    """(tokens generated, requests cancelled by their client) so far."""
    return (metric(url, "ddtree_generated_tokens_total"),
            metric(url, "ddtree_requests_total", endpoint="/v1/completions", status="499"))


def _aborted_quickly(live, generated_before: float, cancelled_before: float, max_tokens: int) -> None:
    health = live.wait_idle()
    assert (health["running"], health["queued"], health["pages_free"]) == (0, 0, health["pages_total"]), health
    assert not live.engine.has_unfinished()
    assert metric(live.url, "ddtree_requests_total", endpoint="/v1/completions", status="499") == cancelled_before + 1
    assert metric(live.url, "ddtree_generated_tokens_total") - generated_before < max_tokens / 2


def test_disconnect_mid_stream_aborts_and_frees_pages(idle_server):
    url = idle_server.url
    generated, cancelled = _counts(url)
    body = {"prompt": "abc", "max_tokens": 240, "ignore_eos": True, "stream": True, "temperature": 0,
            "ddtree": {"mode": "ar"}}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        got = [line for line, _ in zip(lines, range(3)) if line.startswith("data: ")]
        assert got and idle_server.state.scheduler.snapshot["pages_in_use"] > 0
    _aborted_quickly(idle_server, generated, cancelled, 240)


def test_stream_aborted_when_the_client_leaves_before_its_first_byte(idle_server):
    """The client is gone between Accepted and the body's first iteration: the response's first
    send fails (as uvicorn's does once the client left, ASGI 2.4), so the body generator never
    starts; the request must still be aborted and counted. Driven at the ASGI level, so the
    timing is exact."""
    generated, cancelled = _counts(idle_server.url)
    body = json.dumps({"prompt": "abc", "max_tokens": 240, "ignore_eos": True, "stream": True, "temperature": 0,
                       "ddtree": {"mode": "ar"}}).encode()
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.4"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions",
             "query_string": b"", "root_path": "", "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80),
             "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]}
    sent = []

    async def drive():
        messages = [{"type": "http.request", "body": body, "more_body": False}]

        async def receive():
            if messages:
                return messages.pop()
            await asyncio.Event().wait()  # no http.disconnect: only the failed send tells

        async def send(message):
            sent.append(message["type"])
            raise OSError("the client went away")

        with pytest.raises(Exception):  # Starlette's ClientDisconnect, through the middleware
            await idle_server.app(scope, receive, send)

    asyncio.run(drive())
    assert sent[0] == "http.response.start"
    _aborted_quickly(idle_server, generated, cancelled, 240)


def test_disconnect_while_waiting_for_a_full_response(idle_server):
    url = idle_server.url
    generated, cancelled = _counts(url)
    body = {"prompt": "abc", "max_tokens": 250, "ignore_eos": True, "temperature": 0, "ddtree": {"mode": "ar"}}
    with pytest.raises(httpx.ReadTimeout):  # the client gives up and closes the connection
        httpx.post(f"{url}/v1/completions", json=body, timeout=httpx.Timeout(30.0, read=0.15))
    _aborted_quickly(idle_server, generated, cancelled, 250)


def test_full_queue_answers_503_with_retry_after(pairs):
    with start_server(pairs, max_batch=1, max_queue=2) as live:
        body = {"prompt": "q", "max_tokens": 80, "ignore_eos": True, "temperature": 0, "ddtree": {"mode": "ar"}}

        async def burst():
            async with httpx.AsyncClient(timeout=60) as client:
                return await asyncio.gather(*(client.post(f"{live.url}/v1/completions", json=body) for _ in range(6)))

        responses = asyncio.run(burst())
        statuses = sorted(r.status_code for r in responses)
        assert set(statuses) == {200, 503} and statuses.count(200) >= 2, statuses
        for r in responses:
            if r.status_code == 503:
                assert r.headers["retry-after"] == "1" and r.json()["error"]["code"] == "queue_full"
            else:
                assert r.json()["usage"]["completion_tokens"] == 80
        health = live.wait_idle()
        assert health["pages_free"] == health["pages_total"] and health["queued"] == 0
        ok = httpx.post(f"{live.url}/v1/completions", json={**body, "max_tokens": 3}, timeout=60)
        assert ok.status_code == 200  # the queue drained: accepting again


def test_load_200_requests_at_concurrency_32(idle_server):
    url = idle_server.url
    generated = metric(url, "ddtree_generated_tokens_total")
    bodies = []
    for i in range(200):
        body = {"prompt": PROMPTS[i % len(PROMPTS)] + str(i), "max_tokens": 3 + i % 6, "temperature": 0.7,
                "seed": i, "stream": i % 2 == 0, "ddtree": {"mode": ("ar", "chain", "ddtree")[i % 3], "budget": 8}}
        bodies.append(body)
    start = time.monotonic()
    results = asyncio.run(_all(url, bodies, concurrency=32))
    assert [status for status, _, _ in results] == [200] * 200
    assert all(1 <= u["completion_tokens"] <= b["max_tokens"] for b, (_, _, u) in zip(bodies, results))
    total = sum(u["completion_tokens"] for _, _, u in results)
    assert metric(url, "ddtree_generated_tokens_total") - generated == total
    assert time.monotonic() - start < 120
