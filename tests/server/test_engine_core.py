"""The engine in a process of its own (server/engine_core.py): it serves what the scheduler thread
serves, token for token; a core that dies fails its requests with a 503 and says why; no core
outlives its server; a core that cannot load is the launch's one error."""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import httpx
import pytest

from ddtree import Engine
from ddtree.arguments import UsageError
from ddtree.server.app import ServerConfig, create_app, engine_facts
from ddtree.server.engine_core import EngineCore

from .conftest import ENGINE_ARGS
from .harness import LiveServer
from .test_api import served_alone


def _core(pairs, **kwargs) -> EngineCore:
    build = functools.partial(Engine.from_pretrained, str(pairs["target_chat"]), str(pairs["drafter"]), max_batch=4,
                              **ENGINE_ARGS)
    return EngineCore(build, engine_facts, max_queue=8, **kwargs)


def _gone(pid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        if _zombie(pid):
            return True
        time.sleep(0.05)
    return False


def _zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def _complete(url: str, prompt: str, budget) -> dict:
    body = {"prompt": prompt, "max_tokens": 12, "temperature": 0, "ddtree": {"budget": budget}}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=120).json()


def _assert_a_stop_string_ends_it_as_served_alone(url: str, reference) -> None:
    whole = served_alone(reference, "cabbage", 30, mode="ar")
    stop = whole.text[4:6]  # reached by the greedy continuation
    alone = served_alone(reference, "cabbage", 30, mode="ar", stop=[stop])
    body = {"prompt": "cabbage", "max_tokens": 30, "temperature": 0, "stop": stop, "ddtree": {"mode": "ar"}}
    cut = httpx.post(f"{url}/v1/completions", json=body, timeout=120).json()
    assert (cut["choices"][0]["text"], cut["choices"][0]["finish_reason"]) == (alone.text, "stop")
    assert cut["usage"]["completion_tokens"] == len(alone.token_ids) < len(whole.token_ids)


def test_the_core_serves_what_a_request_served_alone_gets(pairs, reference):
    core = _core(pairs)
    facts = core.launch()
    assert facts == engine_facts(reference) | {"max_budget": 16}
    config = ServerConfig(model_name="tiny", default_mode="ddtree", default_budget=8)
    with LiveServer(create_app(core, config)) as live:
        prompts = ["ab", "abcab", "ba", "cabbage"]
        got = [None] * len(prompts)
        threads = [threading.Thread(target=lambda i=i: got.__setitem__(i, _complete(live.url, prompts[i], 8)))
                   for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        for prompt, body in zip(prompts, got):
            alone = served_alone(reference, prompt, 12)
            assert body["choices"][0]["text"] == alone.text, prompt
            assert body["usage"]["completion_tokens"] == len(alone.token_ids)
        health = live.wait_idle()
        assert (health["running"], health["queued"], health["pages_free"]) == (0, 0, health["pages_total"])
        metrics = httpx.get(f"{live.url}/metrics", timeout=5).text
        total = sum(body["usage"]["completion_tokens"] for body in got)  # the core's counts reach this registry
        assert f"ddtree_generated_tokens_total {float(total)}" in metrics
        _assert_a_stop_string_ends_it_as_served_alone(live.url, reference)  # decoded and cut in this process
        health = live.wait_idle()  # the core aborted it: nothing runs, every page is free
        assert (health["running"], health["live"], health["pages_free"]) == (0, 0, health["pages_total"])
        # Chat messages are rendered and encoded in this process too; the core gets token ids
        messages = [{"role": "user", "content": "abc"}]
        chat = httpx.post(f"{live.url}/v1/chat/completions", json={"messages": messages, "max_tokens": 8,
                                                                  "temperature": 0, "ddtree": {"budget": 8}},
                          timeout=120).json()
        alone = served_alone(reference, messages, 8)
        assert chat["choices"][0]["message"]["content"] == alone.text
        assert chat["usage"]["completion_tokens"] == len(alone.token_ids)
        pid = core.pid
    assert _gone(pid, 10), "the core outlived its server"


def test_a_core_that_dies_fails_its_requests_with_503(pairs):
    core = _core(pairs)
    core.launch()
    died = threading.Event()
    core.on_death = died.set
    with LiveServer(create_app(core, ServerConfig(model_name="tiny", default_budget=8))) as live:
        os.kill(core.pid, signal.SIGSTOP)  # the request below is surely still held when the core dies
        answers = []
        thread = threading.Thread(target=lambda: answers.append(httpx.post(
            f"{live.url}/v1/completions", json={"prompt": "ab", "max_tokens": 8}, timeout=60)))
        thread.start()
        deadline = time.monotonic() + 30
        while core.idle and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not core.idle
        os.kill(core.pid, signal.SIGKILL)
        assert died.wait(10)
        thread.join(30)
        assert answers[0].status_code == 503 and answers[0].json()["error"]["code"] == "engine_dead", answers[0].text
        assert "exit code -9" in core.died
        health = httpx.get(f"{live.url}/health", timeout=5)
        assert health.status_code == 503 and health.json()["status"] == "unavailable"
        refused = httpx.post(f"{live.url}/v1/completions", json={"prompt": "ab", "max_tokens": 2}, timeout=10)
        assert refused.status_code == 503 and "engine process stopped unexpectedly" in refused.json()["error"]["message"]
        leaving = time.monotonic()
    assert time.monotonic() - leaving < 5, "stopping a server whose core is dead must not wait on it"


def _raise(error):
    raise error


@pytest.mark.parametrize("error,kind", [(UsageError("--target x: no config.json"), UsageError),
                                        (MemoryError("out of device memory"), RuntimeError)])
def test_a_core_that_cannot_load_is_one_error(error, kind):
    core = EngineCore(functools.partial(_raise, error), engine_facts)
    with pytest.raises(kind, match=str(error.args[0])):
        core.launch()
    assert _gone(core.pid, 10)


def test_the_core_ends_with_its_server(pairs, tmp_path):
    """A server killed outright (no drain, no stop message) leaves no engine process behind."""
    script = textwrap.dedent(f"""
        import functools, sys, time
        from ddtree import Engine
        from ddtree.server.app import engine_facts
        from ddtree.server.engine_core import EngineCore
        if __name__ == "__main__":
            core = EngineCore(functools.partial(Engine.from_pretrained, {str(pairs["target"])!r}, {str(pairs["drafter"])!r},
                                                device="cpu", max_batch=1, page_size=8, max_model_len=64), engine_facts)
            core.launch()
            core.start()
            print(core.pid, flush=True)
            time.sleep(600)
    """)
    (tmp_path / "server.py").write_text(script)
    proc = subprocess.Popen([sys.executable, str(tmp_path / "server.py")], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "TRITON_INTERPRET": "1"})
    try:
        pid = int(proc.stdout.readline())
        assert not _gone(pid, 0.5)
        proc.kill()
        proc.wait(10)
        assert _gone(pid, 10), "the engine process outlived its server"
    finally:
        if proc.poll() is None:
            proc.kill()


def test_two_threads_stopping_the_core_at_once_both_return(pairs):
    """The app's lifespan stops the core from a worker thread while the server's owner may stop it
    too: both calls return (two zmq Context.term calls at once would hang one), the core is gone."""
    core = _core(pairs)
    core.launch()
    core.start()
    pid = core.pid
    start = threading.Barrier(2)
    threads = [threading.Thread(target=lambda: (start.wait(), core.stop()), daemon=True) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not any(thread.is_alive() for thread in threads), "a concurrent stop() hung"
    assert _gone(pid, 10)


def _children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(child) for child in f.read().split()]


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_while_the_core_loads_leaves_no_core(pairs, sig):
    """Ctrl-C (or SIGTERM) while the engine process measures its round costs: the server ends at
    once and takes its engine process with it."""
    from .harness import free_port, tiny_serve_argv

    proc = subprocess.Popen(tiny_serve_argv(pairs, free_port()), env={**os.environ, "TRITON_INTERPRET": "1"},
                            stderr=subprocess.PIPE, text=True)
    try:
        for line in proc.stderr:  # printed by the engine process, which is loading
            if "measuring round costs" in line:
                break
        cores = _children(proc.pid)
        assert cores, "no engine process while it loads"
        proc.send_signal(sig)
        proc.wait(30)
        assert all(_gone(pid, 10) for pid in cores), "an engine process outlived its server"
    finally:
        if proc.poll() is None:
            proc.kill()


class _Unpicklable:
    """A tokenizer that does not pickle (as a remote-code class the HTTP process may not import)."""

    def __init__(self, inner):
        self.inner = inner

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def __call__(self, *args, **kwargs):
        return self.inner(*args, **kwargs)

    def __reduce__(self):
        raise TypeError("cannot pickle this tokenizer")


def _with_unpicklable_tokenizer(target, drafter):
    engine = Engine.from_pretrained(target, drafter, max_batch=4, **ENGINE_ARGS)
    engine.tokenizer = _Unpicklable(engine.tokenizer)
    return engine


def test_a_tokenizer_that_does_not_pickle_leaves_the_text_in_the_core(pairs, reference):
    """The core then decodes, cuts stop strings and encodes prompts itself, as in one process."""
    from ddtree.server.core_process import tokenizer_to_send

    assert tokenizer_to_send(_Unpicklable(reference.tokenizer)) == (None, True)
    assert tokenizer_to_send(None) == (None, False)
    build = functools.partial(_with_unpicklable_tokenizer, str(pairs["target_chat"]), str(pairs["drafter"]))
    core = EngineCore(build, engine_facts, max_queue=8)
    core.launch()
    config = ServerConfig(model_name="tiny", default_mode="ddtree", default_budget=8)
    with LiveServer(create_app(core, config)) as live:
        _assert_a_stop_string_ends_it_as_served_alone(live.url, reference)  # decoded and cut in the core
        live.wait_idle()


def _slow_first_step(target, drafter, seconds: float):
    engine = Engine.from_pretrained(target, drafter, max_batch=2, **ENGINE_ARGS)
    step, calls = engine.step, []

    def slow():
        calls.append(None)
        if len(calls) == 1:
            time.sleep(seconds)  # a compile, a capture or a long prefill on the request path
        return step()

    engine.step = slow
    return engine


def test_a_scrape_is_answered_while_a_step_runs(pairs):
    """With several API servers the core keeps the one registry and answers every scrape; its main
    thread reads the sockets beside the scheduler thread, so a scrape does not wait for a step (a
    version that read them between steps answered after the step, or 503 past 5 s)."""
    build = functools.partial(_slow_first_step, str(pairs["target_chat"]), str(pairs["drafter"]), 4.0)
    core = EngineCore(build, engine_facts, max_queue=8, api_servers=2)  # the second API server never attaches
    core.launch()
    with LiveServer(create_app(core, ServerConfig(model_name="tiny", default_mode="ar"))) as live:
        done = {}

        def generate():
            done["status"] = httpx.post(f"{live.url}/v1/completions", json={"prompt": "hello", "max_tokens": 3,
                                                                              "temperature": 0}, timeout=60).status_code

        thread = threading.Thread(target=generate)
        thread.start()
        time.sleep(1.0)  # the first step is running now
        start = time.monotonic()
        scrape = httpx.get(f"{live.url}/metrics", timeout=30)
        elapsed = time.monotonic() - start
        thread.join(30)
        assert scrape.status_code == 200 and "ddtree_requests_running" in scrape.text
        assert elapsed < 2.0, f"the scrape waited {elapsed:.2f} s for the step"
        assert done == {"status": 200}
        live.wait_idle()
