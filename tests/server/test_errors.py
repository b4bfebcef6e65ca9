"""Bad input never takes the server down or leaks pages: every malformed or unsupported request is
a 4xx with an OpenAI error body naming the field; internal failures fail their requests alone (500,
logged with the id) and the server keeps serving."""

import concurrent.futures
import json
import logging
import re
import time

import httpx
import pytest

from .conftest import BODY_LIMIT, start_server
from .harness import sse_events
from .test_api import served_alone

C, CHAT = "/v1/completions", "/v1/chat/completions"
USER = [{"role": "user", "content": "hi"}]

BAD = [  # (endpoint, body: dict or raw bytes, status, param)
    (C, b'{"prompt": "x",', 400, None),  # invalid JSON
    (C, b"[1, 2]", 400, None),  # not an object
    (C, b'{"prompt": "\xff\xfe"}', 400, None),  # not UTF-8
    (C, b'{"prompt": "x", "temperature": NaN}', 400, "temperature"),
    (C, {"prompt": "\ud800"}, 400, "prompt"),  # a lone surrogate: valid JSON, no valid text
    (C, {}, 400, "prompt"),
    (C, {"prompt": "x", "foo": 1}, 400, "foo"),
    (C, {"prompt": "x", "max_tokens": "5"}, 400, "max_tokens"),
    (C, {"prompt": "x", "max_tokens": 5.0}, 400, "max_tokens"),
    (C, {"prompt": "x", "stream": "yes"}, 400, "stream"),
    (C, {"prompt": 5}, 400, "prompt"),
    (C, {"prompt": "x", "temperature": "hot"}, 400, "temperature"),
    (C, {"prompt": ""}, 400, "prompt"),
    (C, {"prompt": []}, 400, "prompt"),
    (C, {"prompt": ["a", "b"]}, 400, "prompt"),
    (C, {"prompt": [1, 500]}, 400, "prompt"),  # token id outside the vocabulary
    (C, {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    (C, {"prompt": "x", "max_tokens": -3}, 400, "max_tokens"),
    (C, {"prompt": "x", "max_tokens": 256}, 400, "max_tokens"),  # prompt + max_tokens > max_model_len
    (C, {"prompt": "x" * 300, "max_tokens": 1}, 400, "prompt"),  # the prompt alone is over the context
    (C, {"prompt": "x", "temperature": -0.5}, 400, "temperature"),
    (C, {"prompt": "x", "top_p": 0}, 400, "top_p"),
    (C, {"prompt": "x", "top_p": 1.5}, 400, "top_p"),
    (C, {"prompt": "x", "n": 2}, 400, "n"),
    (C, {"prompt": "x", "best_of": 3}, 400, "best_of"),
    (C, {"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
    (C, {"prompt": "x", "stop": [""]}, 400, "stop"),
    (C, {"prompt": "x", "logprobs": 1}, 400, "logprobs"),
    (C, {"prompt": "x", "echo": True}, 400, "echo"),
    (C, {"prompt": "x", "presence_penalty": 0.5}, 400, "presence_penalty"),
    (C, {"prompt": "x", "seed": -1}, 400, "seed"),
    (C, {"prompt": "x", "stream_options": {"include_usage": True}}, 400, "stream_options"),
    (C, {"prompt": "x", "stream": True, "stream_options": {"usage": True}}, 400, "stream_options.usage"),
    (C, {"prompt": "x", "ddtree": {"mode": "beam"}}, 400, "ddtree.mode"),
    (C, {"prompt": "x", "ddtree": {"budget": 0}}, 400, "ddtree.budget"),
    (C, {"prompt": "x", "ddtree": {"budget": 1000}}, 400, "ddtree.budget"),  # over max_budget
    (C, {"prompt": "x", "ddtree": {"depth": 3}}, 400, "ddtree.depth"),
    (C, {"prompt": "x", "model": "gpt-4"}, 404, "model"),
    (CHAT, {}, 400, "messages"),
    (CHAT, {"messages": []}, 400, "messages"),
    (CHAT, {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages[0].role"),
    (CHAT, {"messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, 400,
     "messages[0].content"),
    (CHAT, {"messages": USER, "max_completion_tokens": 0}, 400, "max_completion_tokens"),
    (CHAT, {"messages": USER, "max_completion_tokens": 250}, 400, "max_completion_tokens"),
    (CHAT, {"messages": USER, "n": 4}, 400, "n"),
    (CHAT, {"messages": USER, "logprobs": True}, 400, "logprobs"),
    (CHAT, {"messages": USER, "tools": [{"type": "function"}]}, 400, "tools"),
    (CHAT, {"messages": USER, "response_format": {"type": "json_object"}}, 400, "response_format"),
    (CHAT, {"messages": [{"role": "user", "content": "x" * 300}]}, 400, "messages"),
]


@pytest.mark.parametrize("endpoint,body,status,param", BAD, ids=[f"{i}-{b[3]}" for i, b in enumerate(BAD)])
def test_bad_input_is_a_4xx_naming_the_field(idle_server, endpoint, body, status, param):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(f"{idle_server.url}{endpoint}", content=content, headers={"content-type": "application/json"},
                   timeout=30)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"]
    assert error["param"] == param, error


def test_oversized_bodies_are_413_with_or_without_a_length(idle_server):
    big = json.dumps({"prompt": "x" * BODY_LIMIT}).encode()
    r = httpx.post(f"{idle_server.url}{C}", content=big, timeout=30)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

    def chunks():  # chunked transfer: no Content-Length, the limit is met while reading
        for i in range(0, len(big), 8192):
            yield big[i : i + 8192]

    r = httpx.post(f"{idle_server.url}{C}", content=chunks(), timeout=30)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"


def test_unknown_routes_and_methods_get_openai_error_bodies(idle_server):
    assert httpx.get(f"{idle_server.url}/v1/nothing", timeout=10).json()["error"]["code"] == "not_found"
    r = httpx.get(f"{idle_server.url}{C}", timeout=10)
    assert r.status_code == 405 and r.json()["error"]["code"] == "method_not_allowed"


def test_an_engine_step_failure_fails_the_batch_and_the_server_goes_on(idle_server, reference, caplog):
    engine = idle_server.engine
    body = {"prompt": "abc", "max_tokens": 200, "ignore_eos": True, "temperature": 0, "stream": True,
            "ddtree": {"mode": "ar"}}

    def faulty():  # one failing step, then the real method again
        del engine.step
        raise RuntimeError("injected step failure")

    with httpx.stream("POST", f"{idle_server.url}{C}", json=body, timeout=60) as a, \
            httpx.stream("POST", f"{idle_server.url}{C}", json=body, timeout=60) as b:
        streams = [a.iter_lines(), b.iter_lines()]
        firsts = [next(line for line in s if line.startswith("data: ")) for s in streams]
        ids = [json.loads(f[6:])["id"] for f in firsts]
        with caplog.at_level(logging.ERROR, logger="ddtree.server"):
            engine.step = faulty
            rests = [sse_events(s) for s in streams]
    for request_id, events in zip(ids, rests):
        assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "internal_error"
        assert request_id in events[-2]["error"]["message"]
    assert "injected step failure" in caplog.text and all(request_id in caplog.text for request_id in ids)
    health = idle_server.wait_idle()
    assert health["status"] == "ok" and health["pages_free"] == health["pages_total"]
    alone = served_alone(reference, "abc", 6, mode="ddtree")
    r = httpx.post(f"{idle_server.url}{C}", json={"prompt": "abc", "max_tokens": 6, "temperature": 0}, timeout=60)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == alone.text


def test_a_step_failure_spares_the_requests_still_waiting(pairs, reference):
    with start_server(pairs, max_batch=1) as live:
        engine = live.engine
        running = {"prompt": "abc", "max_tokens": 200, "ignore_eos": True, "temperature": 0, "stream": True,
                   "ddtree": {"mode": "ar"}}

        def faulty():
            del engine.step
            raise RuntimeError("injected step failure")

        with httpx.stream("POST", f"{live.url}{C}", json=running, timeout=60) as a, \
                concurrent.futures.ThreadPoolExecutor(1) as pool:
            lines = a.iter_lines()
            next(line for line in lines if line.startswith("data: "))
            waiting = pool.submit(httpx.post, f"{live.url}{C}", timeout=60,
                                  json={"prompt": "wait", "max_tokens": 6, "temperature": 0})
            deadline = time.monotonic() + 30
            while engine.num_waiting == 0 and time.monotonic() < deadline:  # in the engine's queue (one slot)
                time.sleep(0.005)
            engine.step = faulty
            events = sse_events(lines)
            assert events[-2]["error"]["code"] == "internal_error"
            r = waiting.result()
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == served_alone(reference, "wait", 6).text
        health = live.wait_idle()
        assert health["pages_free"] == health["pages_total"]


def test_a_failure_in_one_request_fails_it_alone(idle_server, reference, caplog):
    engine = idle_server.engine
    poison = reference.tokenize("poison")  # the server's tokenizer belongs to its scheduler thread
    take = engine.take_result

    def take_result(request_id):
        result = take(request_id)
        if result.prompt_token_ids == poison:
            raise ValueError("injected delivery failure")
        return result

    engine.take_result = take_result
    bodies = [{"prompt": "poison", "max_tokens": 5, "temperature": 0},
              {"prompt": "healthy", "max_tokens": 7, "temperature": 0}]
    try:
        with caplog.at_level(logging.ERROR, logger="ddtree.server"), httpx.Client(timeout=60) as client, \
                concurrent.futures.ThreadPoolExecutor(2) as pool:
            bad, good = pool.map(lambda b: client.post(f"{idle_server.url}{C}", json=b), bodies)
    finally:
        del engine.take_result
    assert bad.status_code == 500 and bad.json()["error"]["type"] == "server_error"
    request_id = re.search(r"request (cmpl-[0-9a-f]+)", bad.json()["error"]["message"]).group(1)
    assert request_id in caplog.text and "injected delivery failure" in caplog.text
    assert good.status_code == 200 and good.json()["choices"][0]["text"] == served_alone(reference, "healthy", 7).text
