"""The OpenAI endpoints over a real server: completions and chat, streamed and not, equal to the
same request served alone by an engine of its own; /v1/models, /health, /metrics; the openai client."""

import httpx
import pytest

openai = pytest.importorskip("openai")

from .harness import metric, sse_events  # noqa: E402


def served_alone(reference, prompt, max_tokens, mode="ddtree", budget=8, temperature=0.0, seed=None, stop=None):
    """The reference engine's output for one request (prompt: text, token ids, or chat messages)."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], dict):
        text = reference.tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
        prompt = list(reference.tokenizer(text, add_special_tokens=False)["input_ids"])
    return reference.generate([prompt], max_new_tokens=max_tokens, mode=mode, budget=budget, temperature=temperature,
                              seed=seed, stop=stop)[0]


def test_completion_equals_the_request_served_alone(idle_server, reference):
    body = {"model": "tiny", "prompt": "def fib(n):", "max_tokens": 14, "temperature": 0,
            "ddtree": {"mode": "ddtree", "budget": 8}}
    r = httpx.post(f"{idle_server.url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    out = r.json()
    alone = served_alone(reference, "def fib(n):", 14)
    assert out["object"] == "text_completion" and out["id"].startswith("cmpl-") and out["model"] == "tiny"
    assert r.headers["x-request-id"] == out["id"]
    choice = out["choices"][0]
    assert (choice["text"], choice["finish_reason"]) == (alone.text, alone.finish_reason)
    usage = out["usage"]
    assert usage["prompt_tokens"] == len("def fib(n):") and usage["completion_tokens"] == len(alone.token_ids)
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    stats = usage["ddtree"]
    assert (stats["mode"], stats["budget"], stats["rounds"]) == ("ddtree", 8, alone.stats.rounds)
    assert stats["mean_acceptance_length"] == pytest.approx(alone.stats.mean_acceptance_length, abs=1e-3)
    assert stats["seed"] is None  # greedy: no seed to report


def test_sampled_request_without_a_seed_reports_the_one_drawn(idle_server, reference):
    body = {"prompt": "def fib(n):", "max_tokens": 12, "temperature": 0.7, "ddtree": {"mode": "ar"}}
    r = httpx.post(f"{idle_server.url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    first = r.json()
    seed = first["usage"]["ddtree"]["seed"]
    assert isinstance(seed, int) and seed >= 0
    # the reported seed is the one used: sent back, it replays the completion, and so does an engine of its own
    again = httpx.post(f"{idle_server.url}/v1/completions", json=body | {"seed": seed}, timeout=60)
    assert again.status_code == 200, again.text
    replay = again.json()
    assert replay["choices"][0]["text"] == first["choices"][0]["text"]
    assert replay["usage"]["completion_tokens"] == first["usage"]["completion_tokens"]
    assert replay["usage"]["ddtree"]["seed"] == seed
    alone = served_alone(reference, "def fib(n):", 12, mode="ar", temperature=0.7, seed=seed)
    assert (first["choices"][0]["text"], first["usage"]["completion_tokens"]) == (alone.text, len(alone.token_ids))


def test_token_id_prompt_and_stop_string(idle_server, reference):
    ids = reference.tokenize("x = [1, 2")
    alone = served_alone(reference, "x = [1, 2", 30, mode="ar", stop=None)
    stop = alone.text[3:5]  # a stop string the greedy continuation does reach
    alone = served_alone(reference, ids, 30, mode="ar", stop=[stop])
    r = httpx.post(f"{idle_server.url}/v1/completions", timeout=60, json={
        "prompt": ids, "max_tokens": 30, "temperature": 0, "stop": stop, "ddtree": {"mode": "ar"}})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["text"] == alone.text and choice["finish_reason"] == "stop" and stop not in choice["text"]


def test_streamed_completion_chunks_add_up(idle_server, reference):
    body = {"prompt": "import os", "max_tokens": 16, "temperature": 0.8, "seed": 7, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
            "ddtree": {"mode": "chain"}}
    with httpx.stream("POST", f"{idle_server.url}/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r.iter_lines())
    alone = served_alone(reference, "import os", 16, mode="chain", temperature=0.8, seed=7)
    assert events[-1] == "[DONE]"
    chunks, final = events[:-2], events[-2]
    assert all(c["object"] == "text_completion" and c["id"] == chunks[0]["id"] for c in chunks)
    assert "".join(c["choices"][0]["text"] for c in chunks) == alone.text
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * (len(chunks) - 1) + [alone.finish_reason]
    counts = [c["usage"]["completion_tokens"] for c in chunks]
    assert counts == sorted(counts) and counts[-1] == len(alone.token_ids)
    assert final["choices"] == [] and final["usage"]["completion_tokens"] == len(alone.token_ids)
    assert final["usage"]["ddtree"]["seed"] == 7


def test_chat_streamed_and_not(idle_server, reference):
    system = {"role": "system", "content": "be brief"}
    messages = [system, {"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    alone = served_alone(reference, [system, {"role": "user", "content": "hi"}], 12)
    body = {"messages": messages, "max_completion_tokens": 12, "temperature": 0}
    r = httpx.post(f"{idle_server.url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["object"] == "chat.completion" and out["id"].startswith("chatcmpl-")
    assert out["choices"][0]["message"] == {"role": "assistant", "content": alone.text}
    assert out["usage"]["prompt_tokens"] == len("<system>be brief\n<user>hi\n<assistant>")
    with httpx.stream("POST", f"{idle_server.url}/v1/chat/completions", json={**body, "stream": True}, timeout=60) as r:
        events = sse_events(r.iter_lines())
    assert events[-1] == "[DONE]" and events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    chunks = events[:-1]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == alone.text
    assert chunks[-1]["choices"][0]["finish_reason"] == alone.finish_reason


def test_chat_without_a_template_is_a_clear_400(pairs):
    from .conftest import start_server

    with start_server(pairs, target="target") as live:
        r = httpx.post(f"{live.url}/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]},
                       timeout=30)
        assert r.status_code == 400
        error = r.json()["error"]
        assert error["param"] == "messages" and error["code"] == "chat_template_missing"
        assert "chat template" in error["message"]
        r = httpx.post(f"{live.url}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=30)
        assert r.status_code == 200


def test_models_health_and_metrics(idle_server):
    models = httpx.get(f"{idle_server.url}/v1/models", timeout=10).json()
    assert models["object"] == "list" and [m["id"] for m in models["data"]] == ["tiny"]
    card = models["data"][0]
    assert card["max_model_len"] == 256 and card["ddtree"]["modes"] == ["ar", "chain", "ddtree"]
    health = httpx.get(f"{idle_server.url}/health", timeout=10).json()
    assert health["status"] == "ok" and health["pages_total"] == idle_server.engine.blocks.num_pages
    before = metric(idle_server.url, "ddtree_requests_total", endpoint="/v1/completions", status="200")
    tokens = metric(idle_server.url, "ddtree_generated_tokens_total")
    r = httpx.post(f"{idle_server.url}/v1/completions", json={"prompt": "ab", "max_tokens": 5, "temperature": 0},
                   timeout=30)
    generated = r.json()["usage"]["completion_tokens"]
    text = httpx.get(f"{idle_server.url}/metrics", timeout=10)
    assert text.headers["content-type"].startswith("text/plain")
    for name in ("ddtree_acceptance_length_bucket", "ddtree_round_seconds_bucket", "ddtree_requests_running",
                 "ddtree_requests_queued", "ddtree_kv_pages_in_use", "ddtree_kv_pages_free",
                 "ddtree_prompt_tokens_total"):
        assert name in text.text
    assert metric(idle_server.url, "ddtree_requests_total", endpoint="/v1/completions", status="200") == before + 1
    assert metric(idle_server.url, "ddtree_generated_tokens_total") == tokens + generated
    assert metric(idle_server.url, "ddtree_kv_pages_free") == idle_server.engine.blocks.num_pages
    # a CPU engine has no round graphs: neither count moves
    assert metric(idle_server.url, "ddtree_eager_rounds") == metric(idle_server.url, "ddtree_round_graphs") == 0


def test_the_openai_client(idle_server, reference):
    client = openai.OpenAI(base_url=f"{idle_server.url}/v1", api_key="unused", max_retries=0, timeout=60)
    alone = served_alone(reference, "class A:", 10, mode="ddtree", budget=4)
    out = client.completions.create(model="tiny", prompt="class A:", max_tokens=10, temperature=0,
                                    extra_body={"ddtree": {"mode": "ddtree", "budget": 4}})
    assert out.choices[0].text == alone.text and out.usage.completion_tokens == len(alone.token_ids)
    assert out.usage.model_extra["ddtree"]["budget"] == 4
    stream = client.completions.create(model="tiny", prompt="class A:", max_tokens=10, temperature=0, stream=True,
                                       extra_body={"ddtree": {"mode": "ddtree", "budget": 4}})
    assert "".join(c.choices[0].text for c in stream) == alone.text
    messages = [{"role": "user", "content": "hello"}]
    chat_alone = served_alone(reference, messages, 9, mode="ar")
    chat = client.chat.completions.create(model="tiny", messages=messages, max_tokens=9, temperature=0,
                                          extra_body={"ddtree": {"mode": "ar"}})
    assert chat.choices[0].message.content == chat_alone.text
    pieces = client.chat.completions.create(model="tiny", messages=messages, max_tokens=9, temperature=0,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"ddtree": {"mode": "ar"}})
    parts = list(pieces)
    assert "".join(p.choices[0].delta.content or "" for p in parts if p.choices) == chat_alone.text
    assert parts[-1].usage.completion_tokens == len(chat_alone.token_ids)
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="tiny", prompt="x", max_tokens=10, temperature=3)
    assert err.value.param == "temperature"
    with pytest.raises(openai.NotFoundError) as err:
        client.completions.create(model="gpt-4", prompt="x")
    assert err.value.code == "model_not_found"
    assert [m.id for m in client.models.list()] == ["tiny"]


def test_auto_budget_request_equals_ar_and_feeds_the_size_histogram(idle_server, reference):
    before = metric(idle_server.url, "ddtree_tree_size_count")
    body = {"prompt": "def fib(n):", "max_tokens": 12, "temperature": 0, "ddtree": {"mode": "ddtree", "budget": "auto"}}
    r = httpx.post(f"{idle_server.url}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["choices"][0]["text"] == served_alone(reference, "def fib(n):", 12, mode="ar").text
    stats = out["usage"]["ddtree"]
    assert stats["budget"] == "auto"
    assert metric(idle_server.url, "ddtree_tree_size_count") == before + stats["rounds"]
    bad = httpx.post(f"{idle_server.url}/v1/completions", json={**body, "ddtree": {"budget": "big"}}, timeout=10)
    assert bad.status_code == 400 and "ddtree.budget" in bad.text
