"""`ddtree serve` from the command line: a real server process on a free loopback port, and
one-line errors (the demo pair missing, a drafter without its target)."""

import os
import re
import select
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

import ddtree.demo
from ddtree.cli import main
from ddtree.engine.kept_costs import cache_dir

from .harness import free_port, serve_process, stop_process, stream_in_thread, tiny_serve_argv


def test_serve_runs_a_server_until_interrupted(pairs):
    port = free_port()
    argv = [sys.executable, "-m", "ddtree", "serve", "--target", str(pairs["target"]), "--drafter",
            str(pairs["drafter"]), "--device", "cpu", "--port", str(port), "--page-size", "8", "--max-model-len", "128",
            "--max-batch", "2", "--budget", "4", "--max-budget", "8", "--log-level", "warning"]
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline, health = time.monotonic() + 120, None
        while health is None and proc.poll() is None and time.monotonic() < deadline:
            try:
                health = httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).json()
            except httpx.TransportError:
                time.sleep(0.2)
        assert health is not None, proc.stderr.read() if proc.poll() is not None else "no /health in 120 s"
        assert (health["model"], health["default_budget"], health["max_budget"]) == ("target", 4, 8)
        if not os.environ.get("OMP_NUM_THREADS"):  # a core left to the event loop
            assert health["cpu_threads"] == max(1, len(os.sched_getaffinity(0)) - 1)
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json={"prompt": "ab", "max_tokens": 3}, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["ddtree"]["budget"] == 4
    finally:
        stop_process(proc)
    assert proc.returncode == 0
    err = proc.stderr.read()
    assert f"http://127.0.0.1:{port}/v1" in err
    kept = list((cache_dir() / "round_costs").glob("*.json"))  # measured at start-up and kept for the next
    assert len(kept) == 1 and f"(kept in {kept[0]})" in err
    # what the wait before serving is for, said before it starts
    assert "ddtree serve: measuring round costs for budget auto at batch buckets [1, 2] x tree sizes [0, 1, 2, 4, 8] " \
           "before serving" in err


def test_serve_holds_its_port_while_it_loads(pairs):
    """The port is taken before the model loads and its round costs are measured (no other
    process can take it meanwhile); a request made then waits, and is answered only after the
    server says it serves (its last start-up line, written before uvicorn runs)."""
    port = free_port()
    proc = subprocess.Popen(tiny_serve_argv(pairs, port), env={**os.environ, "TRITON_INTERPRET": "1"},
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline, taken = time.monotonic() + 120, False
        while not taken and proc.poll() is None and time.monotonic() < deadline:
            with socket.socket() as probe:
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # fails only against a listener
                try:
                    probe.bind(("127.0.0.1", port))
                except OSError:
                    taken = True
            time.sleep(0.02)
        assert taken, "the port was never taken"
        err, pipe = b"", proc.stderr.fileno()
        os.set_blocking(pipe, False)
        try:
            err = os.read(pipe, 1 << 16) or b""
        except BlockingIOError:
            pass
        assert b"/v1\n" not in err, "the port was taken only once the server served"
        client = socket.create_connection(("127.0.0.1", port), timeout=120)
        client.sendall(b"GET /health HTTP/1.1\r\nHost: localhost\r\n\r\n")
        while b"/v1\n" not in err:
            readable, _, _ = select.select([pipe, client], [], [], max(0.0, deadline - time.monotonic()))
            assert readable, "no start-up line in 120 s"
            if pipe in readable:  # the pipe first: the line is written before any answer can be
                chunk = os.read(pipe, 1 << 16)
                assert chunk, "the server exited"
                err += chunk
                continue
            assert client not in readable, f"answered before it served: {err.decode()}"
        answer = b""
        while b"\r\n\r\n" not in answer:
            answer += client.recv(1 << 16)
        assert answer.startswith(b"HTTP/1.1 200")
        client.close()
    finally:
        stop_process(proc)


def test_serve_on_port_zero_names_the_port_it_got(pairs):
    proc = subprocess.Popen(tiny_serve_argv(pairs, 0), env={**os.environ, "TRITON_INTERPRET": "1"},
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        line = ""
        while "/v1" not in line:
            line = proc.stderr.readline()
            assert line, "the server exited"
        url = re.search(r"http://127\.0\.0\.1:(\d+)/v1", line)
        assert url and int(url.group(1)) > 0, line
        assert httpx.get(f"{url.group(0)[:-3]}/health", timeout=60).status_code == 200
    finally:
        stop_process(proc)


@pytest.mark.parametrize("drain,completes", [("30", True), ("0.2", False)])
def test_sigterm_drains_then_exits_zero(pairs, drain, completes):
    """SIGTERM: new requests get 503 and /health says draining while the running stream goes on;
    it finishes within the drain, or past it gets an error event; the process exits 0, quietly."""
    proc, url = serve_process(pairs, "--drain-seconds", drain)
    try:
        thread, events, started = stream_in_thread(url, 480)
        assert started.wait(60)
        proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        while completes and time.monotonic() < deadline:  # (a short drain may end before a first look)
            health = httpx.get(f"{url}/health", timeout=5)
            if health.status_code == 503:
                break
            time.sleep(0.02)
        if completes:
            assert health.json()["status"] == "draining"
            refused = httpx.post(f"{url}/v1/completions", json={"prompt": "ab", "max_tokens": 2}, timeout=10)
            assert refused.status_code == 503 and refused.json()["error"]["code"] == "shutting_down"
        thread.join(120)
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    err = proc.stderr.read()
    assert "Traceback" not in err, err
    assert events[-1] == "[DONE]"
    if completes:
        assert events[-2]["choices"][0]["finish_reason"] == "length"
        assert sum(len(e["choices"][0]["text"]) for e in events[:-1]) > 0
    else:
        assert events[-2]["error"]["code"] == "shutting_down"


def test_serve_without_the_demo_pair_is_one_line(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(ddtree.demo, "TARGET_DIR", tmp_path / "no-target")
    assert main(["serve"]) == 1
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "demo pair is not in this install" in err


@pytest.mark.parametrize("argv,message", [
    (["--drafter", "d"], "--drafter needs --target DIR"),
    (["--target", "t", "--mode", "chain"], "--mode chain needs --drafter DIR"),
])
def test_serve_argument_errors_are_one_line(argv, message, capsys):
    assert main(["serve", *argv]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and message in err


@pytest.mark.parametrize("port", ["99999", "-1", "http"])
def test_serve_bad_port_is_an_argparse_error(port, monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(ddtree.demo, "TARGET_DIR", tmp_path / "no-target")  # nothing loads either way
    with pytest.raises(SystemExit) as exit_:
        main(["serve", "--port", port])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "argument --port" in err


def test_serve_port_zero_is_accepted():
    from ddtree.cli import build_parser

    assert build_parser().parse_args(["serve", "--port", "0"]).port == 0


def test_serve_port_in_use_or_a_foreign_host_is_one_line_before_loading(tmp_path, capsys):
    (tmp_path / "config.json").write_text("{}")  # a directory that passes the checks, but no model in it:
    nothing = ["--target", str(tmp_path), "--mode", "ar"]  # reaching the load would say so
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["serve", *nothing, "--port", str(port)]) == 1
    err = capsys.readouterr().err
    assert err.strip() == f"ddtree: error: cannot listen on 127.0.0.1:{port}: Address already in use"
    assert main(["serve", *nothing, "--host", "no-such-host.invalid"]) == 1
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "--host no-such-host.invalid: not an address of this machine" in err
