"""serve_bench's modes: ar, chain, ddtree with --budget, or ddtree:N / ddtree:auto per entry."""

import sys
from pathlib import Path

import pytest

pytest.importorskip("httpx")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from serve_bench import make_bodies, parse_modes  # noqa: E402


def test_modes_carry_their_budget_auto_included():
    assert parse_modes("ar,chain,ddtree,ddtree:16,ddtree:auto", "64") == [
        ("ar", None), ("chain", None), ("ddtree", 64), ("ddtree", 16), ("ddtree", "auto")]
    assert parse_modes("ddtree", "auto") == [("ddtree", "auto")]
    for bad, why in [("tree", "need ar, chain, ddtree"), ("ar:4", "need ar, chain, ddtree"),
                     ("ddtree:0", "a budget is auto or an int > 0"), ("ddtree:big", "a budget is auto")]:
        with pytest.raises(ValueError, match=f"entry '{bad}': {why}"):
            parse_modes(bad, "64")


def test_each_request_sends_its_mode_and_budget():
    class Args:
        max_tokens, temperature, ignore_eos, seed = 8, 0.0, True, 5

    auto = make_bodies(Args, ["a", "b"], "ddtree", "auto", 3, "m", offset=1)
    assert [b["ddtree"] for b in auto] == [{"mode": "ddtree", "budget": "auto"}] * 3
    assert [b["prompt"] for b in auto] == ["b", "a", "b"] and [b["seed"] for b in auto] == [6, 7, 8]
    assert make_bodies(Args, ["a"], "ar", None, 1, "m", offset=0)[0]["ddtree"] == {"mode": "ar"}


def _events_app():
    """An ASGI app streaming three chunks of 1, 2 and 1 tokens, the usage chunk and [DONE]; a body
    asking for max_tokens 0 gets a 400."""
    import json

    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        body = json.loads((await receive())["body"])
        if body["max_tokens"] == 0:
            await send({"type": "http.response.start", "status": 400, "headers": [(b"content-type", b"application/json")]})
            await send({"type": "http.response.body", "body": b'{"error": {"message": "max_tokens must be >= 1"}}'})
            return
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
        for text, used in (("a", 1), ("bc", 3), ("d", 4)):
            event = {"choices": [{"text": text}], "usage": {"completion_tokens": used}}
            await send({"type": "http.response.body", "body": f"data: {json.dumps(event)}\n\n".encode(), "more_body": True})
        usage = {"choices": [], "usage": {"completion_tokens": 4, "ddtree": {"mean_acceptance_length": 1.5}}}
        await send({"type": "http.response.body", "body": f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode()})

    return app


@pytest.mark.parametrize("kind", ["aiohttp", "httpx"])
def test_both_client_libraries_read_a_stream_alike(kind):
    """one_request through open_client's aiohttp and httpx sessions: the same tokens, chunks and usage
    from a stream, and an error naming the status of a refused request."""
    pytest.importorskip(kind)
    uvicorn = pytest.importorskip("uvicorn")
    import asyncio
    import threading
    import time

    from serve_bench import one_request, open_client

    from ddtree.server.listening import listen

    (sock,) = listen("127.0.0.1", 0)
    server = uvicorn.Server(uvicorn.Config(_events_app(), log_level="warning"))
    threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True).start()
    deadline = time.monotonic() + 10
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.02)
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"

    async def both():
        async with open_client(kind, 4) as client:
            return await one_request(client, url, {"max_tokens": 8}), await one_request(client, url, {"max_tokens": 0})

    try:
        streamed, refused = asyncio.run(both())
    finally:
        server.should_exit = True
    assert streamed["error"] is None and streamed["tokens"] == 4 and streamed["ttft"] > 0
    assert len(streamed["chunk_gaps"]) == 2 and len(streamed["token_gaps"]) == 3  # the 2-token chunk counts twice
    assert streamed["usage"]["ddtree"]["mean_acceptance_length"] == 1.5
    assert refused["error"].startswith("HTTP 400: ") and "max_tokens must be >= 1" in refused["error"]
    with pytest.raises(ValueError, match="client must be one of aiohttp, httpx, got 'curl'"):
        asyncio.run(open_client("curl", 1).__aenter__())
