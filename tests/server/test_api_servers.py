"""`ddtree serve --api-server-count N`: HTTP processes sharing the port over one engine core
(server/api_servers.py). Real processes on the tiny pair: both serve, every one reports the totals,
SIGTERM drains them all, and a core or an API server that dies ends the server with one line."""

import os
import re
import signal
import time
from pathlib import Path

import httpx
import pytest

from ddtree.cli import main

from .harness import metric, serve_process, stop_process, stream_in_thread

GREEDY = {"prompt": "ab", "max_tokens": 6, "temperature": 0, "ignore_eos": True, "ddtree": {"mode": "ar"}}


def _serve_two(pairs, *extra):
    """`ddtree serve --api-server-count 2`: (process, url, its start-up lines, the engine process's
    pid, the other API server's pid)."""
    proc, url = serve_process(pairs, "--api-server-count", "2", *extra)
    try:
        text, deadline = "", time.monotonic() + 30
        os.set_blocking(proc.stderr.fileno(), False)
        while "engine process" not in text and time.monotonic() < deadline:
            text += proc.stderr.read() or ""
            time.sleep(0.05)
        os.set_blocking(proc.stderr.fileno(), True)
        core = int(re.search(r"engine process (\d+)", text).group(1))
        children = []
        for task in Path(f"/proc/{proc.pid}/task").glob("*/children"):
            children += [int(pid) for pid in task.read_text().split()]
        others = [pid for pid in children if pid != core and b"resource_tracker" not in _cmdline(pid)]
        assert len(others) == 1, others
        assert _served_by(url) == {0, 1}  # the other one has started serving too
    except BaseException:
        stop_process(proc)
        raise
    return proc, url, text, core, others[0]


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def _served_by(url: str, tries: int = 300) -> set[int]:
    """The API servers that answered /health over fresh connections."""
    seen = set()
    for _ in range(tries):
        seen.add(httpx.get(f"{url}/health", timeout=10).json()["api_server"])
        if len(seen) == 2:
            break
    return seen


def _gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return True
    return state == "Z"


def test_two_api_servers_share_the_port_and_report_the_totals(pairs):
    proc, url = serve_process(pairs, "--api-server-count", "2")
    try:
        assert _served_by(url) == {0, 1}
        health = httpx.get(f"{url}/health", timeout=10).json()
        assert health["api_servers"] == 2 and health["status"] == "ok"
        texts = []
        for _ in range(8):  # fresh connections: both processes serve some of them
            r = httpx.post(f"{url}/v1/completions", json=GREEDY, timeout=60)
            assert r.status_code == 200, r.text
            texts.append(r.json()["choices"][0]["text"])
        assert len(set(texts)) == 1 and texts[0]
        refused = httpx.post(f"{url}/v1/completions", json={**GREEDY, "model": "nope"}, timeout=10)
        assert refused.status_code == 404
        # one registry, in the engine process: every scrape, whichever process answers, reads the same
        deadline, counts = time.monotonic() + 10, None
        while time.monotonic() < deadline:  # the counts travel from each process to the core
            counts = {(metric(url, "ddtree_requests_total", endpoint="/v1/completions", status="200"),
                       metric(url, "ddtree_requests_total", endpoint="/v1/completions", status="404"),
                       metric(url, "ddtree_generated_tokens_total")) for _ in range(12)}
            if counts == {(8.0, 1.0, 48.0)}:
                break
            time.sleep(0.1)
        assert counts == {(8.0, 1.0, 48.0)}
        thread, _, started = stream_in_thread(url, 300)  # under load a counter never goes back between scrapes
        assert started.wait(60)
        read = [metric(url, "ddtree_generated_tokens_total") for _ in range(40)]
        thread.join(60)
        assert read == sorted(read) and read[-1] > read[0], read
    finally:
        stop_process(proc)
    assert proc.returncode == 0


def test_sigterm_drains_every_api_server_then_all_exit_zero(pairs):
    """SIGTERM to the server: both processes refuse new requests (503, /health "draining") while
    the running streams finish; then every process exits, the server with 0."""
    proc, url, _, core, other = _serve_two(pairs, "--drain-seconds", "60", "--max-batch", "4")
    try:
        streams = [stream_in_thread(url, 480) for _ in range(4)]
        for _, _, started in streams:
            assert started.wait(60)
        proc.send_signal(signal.SIGTERM)
        health = httpx.get(f"{url}/health", timeout=10)  # whichever process answers (one busy, the other accepts)
        assert health.status_code == 503 and health.json()["status"] == "draining"
        refused = httpx.post(f"{url}/v1/completions", json=GREEDY, timeout=10)
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "shutting_down"
        for thread, _, _ in streams:
            thread.join(120)
        proc.wait(60)
    finally:
        if proc.poll() is None:
            proc.kill()
    err = proc.stderr.read()
    assert proc.returncode == 0 and "Traceback" not in err, err
    for _, events, _ in streams:
        assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "length"
    deadline = time.monotonic() + 10
    while not (_gone(core) and _gone(other)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _gone(core) and _gone(other)


@pytest.mark.parametrize("victim", ["core", "api_server"])
def test_a_process_that_dies_ends_the_server_with_one_line(pairs, victim):
    """A killed engine core fails the streams of both API servers (an error event) and ends the
    server; so does a killed API server. Exit 1, one error line, no process left."""
    proc, url, start_line, core, other = _serve_two(pairs, "--max-batch", "6")
    try:  # six streams at once, spread over the two processes by the kernel (all on one: 1 time in 32)
        streams = [stream_in_thread(url, 480) for _ in range(6)] if victim == "core" else []
        for _, _, started in streams:
            assert started.wait(60)
        os.kill(core if victim == "core" else other, signal.SIGKILL)
        for thread, _, _ in streams:
            thread.join(60)
        assert proc.wait(60) == 1
    finally:
        if proc.poll() is None:
            stop_process(proc)
    err = start_line + proc.stderr.read()
    errors = [line for line in err.splitlines() if line.startswith("ddtree serve: error:")]
    expected = "engine process stopped unexpectedly" if victim == "core" else "API server 1 ended unexpectedly"
    assert len(errors) == 1 and expected in errors[0], err
    assert "Traceback" not in err, err
    for _, events, _ in streams:
        assert events[-1] == "[DONE]" and events[-2].get("error", {}).get("code") == "engine_dead", events[-2]
    deadline = time.monotonic() + 10
    while not (_gone(core) and _gone(other)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _gone(core) and _gone(other)


def test_api_servers_need_the_engine_in_its_own_process(tmp_path, capsys):
    (tmp_path / "config.json").write_text("{}")
    assert main(["serve", "--target", str(tmp_path), "--mode", "ar", "--port", "0", "--api-server-count", "2",
                 "--single-process"]) == 2
    err = capsys.readouterr().err
    assert err.strip() == "ddtree serve: error: --api-server-count needs the engine in a process of its own (drop " \
                          "--single-process)"


def test_the_core_routes_events_to_their_process_and_updates_to_all(tmp_path, monkeypatch):
    """frontends.Frontends: a request's events reach the process that submitted it only; the
    metric updates and the snapshot reach every process, a process without events of its own
    getting them at most every SPREAD_S (or when forced); events of a request no process waits for
    (ended or aborted) are dropped."""
    import zmq

    from ddtree.server import frontends as routing
    from ddtree.server.jobs import Chunk, Failed, Usage
    from ddtree.server.errors import APIError

    context = zmq.Context()
    addresses = [f"ipc://{tmp_path}/out.{i}" for i in range(2)]
    pulls = [context.socket(zmq.PULL) for _ in addresses]
    for sock, address in zip(pulls, addresses):
        sock.bind(address)
    frontends = routing.Frontends(context, addresses)

    def received(index: int) -> list:
        out = []
        while pulls[index].poll(200):
            out.append(pulls[index].recv_pyobj())
        return out

    try:
        frontends.of.update({"a": 0, "b": 1})
        usage = (3, 1, "ar", None, 0, 0.0, None)
        chunk_a = ("a", "x", 1, usage, None, (5,))
        last_b = ("b", Chunk("y", 1, Usage(*usage), "length", (6,)))  # an object event: to_wire makes it a tuple
        snapshot = {"running": 2}
        frontends.send_turn([chunk_a, last_b, ("gone", "z", 1, usage, None, (7,))], [("tokens", "inc", 2)], snapshot)
        (turn_0,), (turn_1,) = received(0), received(1)
        assert turn_0 == ("turn", [chunk_a], [("tokens", "inc", 2)], snapshot)
        assert turn_1 == ("turn", [("b", "y", 1, usage, "length", (6,))], [("tokens", "inc", 2)], snapshot)
        assert frontends.of == {"a": 0}  # b ended
        # a turn with events for process 0 only: process 1 waits for SPREAD_S before it hears of the updates
        monkeypatch.setattr(routing, "SPREAD_S", 60.0)
        failed = ("a", Failed(APIError(503, "draining", code="shutting_down")))
        frontends.send_turn([failed, ("b", "late", 1, usage, None, (8,))], [("tokens", "inc", 1)], {"running": 0})
        (turn_0,) = received(0)
        (rid, event), = turn_0[1]  # the late chunk of b (ended) is dropped
        assert rid == "a" and isinstance(event, Failed) and event.error.code == "shutting_down"
        assert turn_0[2] == [("tokens", "inc", 1)] and turn_0[3] == {"running": 0}
        assert received(1) == []
        frontends.send_turn([], [("rounds", "observe", 0.5)], {"running": 0})
        assert received(0) == [] and received(1) == []
        frontends.send_turn([], [], {"running": 0}, force=True)
        assert received(0) == [("turn", [], [("rounds", "observe", 0.5)], {"running": 0})]
        assert received(1) == [("turn", [], [("tokens", "inc", 1), ("rounds", "observe", 0.5)], {"running": 0})]
        assert frontends.of == {}
    finally:
        frontends.close()
        for sock in pulls:
            sock.close(linger=0)
        context.term()


@pytest.mark.parametrize("flag", ["--max-queue", "--max-streams"])
def test_a_limit_below_the_api_server_count_is_refused(tmp_path, capsys, flag):
    (tmp_path / "config.json").write_text("{}")
    assert main(["serve", "--target", str(tmp_path), "--mode", "ar", "--port", "0", "--api-server-count", "4",
                 flag, "3"]) == 2
    assert capsys.readouterr().err.strip() == f"ddtree serve: error: {flag} 3 is less than --api-server-count 4: " \
                                              "each API server takes an equal share of it, at least 1"
