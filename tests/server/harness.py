"""Test plumbing for the server: a real uvicorn server in a thread on a free loopback port, `ddtree
serve` in a process of its own, the tiny checkpoints (one target with a chat template),
server-sent event parsing, metric reads."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from ddtree.server.listening import listen

from ..engine.pairs import EOS, make_pair

CHAT_TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<assistant>{% endif %}")


def make_pairs(root: Path) -> dict:
    """target/ + drafter/ (no chat template) and target_chat/ (the same weights, a chat template
    in tokenizer_config.json)."""
    target, drafter, _ = make_pair(root, tokenizer=True, eos_token_id=EOS)
    chat = root / "target_chat"
    shutil.copytree(target, chat)
    config = json.loads((chat / "tokenizer_config.json").read_text())
    (chat / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": CHAT_TEMPLATE}))
    return {"target": target, "drafter": drafter, "target_chat": chat}


class LiveServer:
    """uvicorn serving `app` from a thread on 127.0.0.1 (a free port); a context manager."""

    def __init__(self, app):
        self.app = app
        (self._sock,) = listen("127.0.0.1", 0)  # as serve binds (TCP_NODELAY on what it accepts)
        self.url = f"http://127.0.0.1:{self._sock.getsockname()[1]}"
        config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=2)
        self.server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self._sock]}, daemon=True)

    @property
    def state(self):
        return self.app.state.ddtree

    @property
    def engine(self):
        return self.state.scheduler.engine

    def __enter__(self) -> "LiveServer":
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("the test server did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self._thread.join(15)
        self._sock.close()

    def wait_idle(self, timeout_s: float = 15.0) -> dict:
        """Poll /health until no request is running or queued and every KV page is free; returns
        the last health body (the caller asserts on it)."""
        deadline = time.monotonic() + timeout_s
        while True:
            body = httpx.get(f"{self.url}/health", timeout=5).json()
            idle = body["running"] == 0 and body["queued"] == 0 and body["pages_free"] == body["pages_total"]
            if idle or time.monotonic() > deadline:
                return body
            time.sleep(0.05)


def metric(url: str, name: str, **labels) -> float:
    """One sample of the server's /metrics (0.0 when absent), by sample name and labels."""
    text = httpx.get(f"{url}/metrics", timeout=5).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    return 0.0


def sse_events(lines) -> list:
    """The JSON bodies of a server-sent event stream, then the literal "[DONE]" if it came."""
    events = []
    for line in lines:
        if not line.startswith("data: "):
            assert line == "", f"unexpected stream line {line!r}"
            continue
        data = line[len("data: "):]
        events.append(data if data == "[DONE]" else json.loads(data))
    return events


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop_process(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)


def tiny_serve_argv(pairs, port: int) -> list[str]:
    """`ddtree serve` on the tiny pair at `port`, its round costs measured afresh (it loads a while)."""
    return [sys.executable, "-m", "ddtree", "serve", "--target", str(pairs["target"]), "--drafter",
            str(pairs["drafter"]), "--device", "cpu", "--port", str(port), "--page-size", "8", "--max-model-len", "128",
            "--max-batch", "2", "--max-budget", "8", "--log-level", "warning", "--fresh-costs"]


def serve_process(pairs, *extra) -> tuple[subprocess.Popen, str]:
    """A `ddtree serve` process on a free port, once its /health answers; (process, base url)."""
    port = free_port()
    argv = [sys.executable, "-m", "ddtree", "serve", "--target", str(pairs["target"]), "--drafter",
            str(pairs["drafter"]), "--device", "cpu", "--port", str(port), "--page-size", "8", "--max-model-len", "512",
            "--max-batch", "2", "--max-budget", "8", "--log-level", "warning", *extra]
    proc = subprocess.Popen(argv, env={**os.environ, "TRITON_INTERPRET": "1"}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + 120
    while proc.poll() is None and time.monotonic() < deadline:
        try:
            httpx.get(f"{url}/health", timeout=2)
            return proc, url
        except httpx.TransportError:
            time.sleep(0.2)
    proc.kill()
    raise AssertionError(f"no /health in 120 s: {proc.stderr.read()}")


def stream_in_thread(url: str, max_tokens: int) -> tuple[threading.Thread, list, threading.Event]:
    """A streamed greedy ar request of exactly max_tokens tokens; (thread, its events, set at the first one)."""
    events, started = [], threading.Event()

    def run():
        body = {"prompt": "ab", "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
                "ddtree": {"mode": "ar"}}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:] if line == "data: [DONE]" else json.loads(line[6:]))
                    started.set()

    thread = threading.Thread(target=run)
    thread.start()
    return thread, events, started
