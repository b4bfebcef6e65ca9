"""`ddtree serve` from the command line: a real server process on a free loopback port, and
one-line errors (the demo pair missing, a drafter without its target)."""

import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

import ddtree.demo
from ddtree.cli import main


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serve_runs_a_server_until_interrupted(pairs):
    port = _free_port()
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
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json={"prompt": "ab", "max_tokens": 3}, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["ddtree"]["budget"] == 4
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
    assert proc.returncode == 0
    assert f"http://127.0.0.1:{port}/v1" in proc.stderr.read()


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
