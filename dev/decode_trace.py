"""Where a served token's time goes at one stream, in decode (issue 36: `ar` at c = 1 ran 0.69x the
engine). Runs, in one process on one device, the demo pair's engine driven as serve_vs_engine drives
it (engine_clients, c = 1) at max_batch 1 and at the server's max_batch, then the server (the engine
core built as `ddtree serve` builds it, the app on uvicorn here) with the core's turns marked, and
streamed clients at c = 1: serve_bench's (httpx, in a process of its own) and a raw socket.

    python dev/decode_trace.py --device cuda --tokens 256 --requests 8 [--py-spy 4]

Per turn of the core: the step (engine.step()), what follows it until the turn's send (delivery,
snapshot), the send, and the rest until the next step (inbox, deadlines). --py-spy N records the
core process for N s during the httpx pass (py-spy on PATH or $PY_SPY), top functions by own time.
"""

from __future__ import annotations

import argparse
import functools
import gc
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "dev"))
sys.path.insert(0, str(ROOT / "benchmarks"))

LOG = os.environ.setdefault("DDTREE_DECODE_LOG", os.path.join(tempfile.mkdtemp(prefix="ddtree-decode-"), "marks"))
PROMPT = "def fib(n):"


def traced_core_build(args):
    """Runs in the engine-core process: serve's own build, every turn's step and send marked."""
    from ddtree.server.command import load_for_serving
    from ddtree.server.frontends import Frontends
    from ddtree.server.scheduler import Scheduler

    log = open(LOG, "a", buffering=1 << 16)
    for cls, name, label in ((Scheduler, "_step", "step"), (Frontends, "send_turn", "send")):
        original = getattr(cls, name)

        def traced(*a, _original=original, _label=label, **k):
            log.write(f"{time.perf_counter_ns()} {_label}_in\n")
            try:
                return _original(*a, **k)
            finally:
                log.write(f"{time.perf_counter_ns()} {_label}_out\n")

        setattr(cls, name, traced)

    def flush_often() -> None:
        while True:
            time.sleep(0.5)
            log.flush()

    threading.Thread(target=flush_often, daemon=True).start()
    return load_for_serving(args)


def engine_side(args) -> None:
    from engine_clients import run_clients

    import torch
    from ddtree import Engine, SamplingParams

    params = SamplingParams(max_new_tokens=args.tokens, ignore_eos=True)
    for max_batch in sorted({1, args.max_batch}):
        engine = Engine.from_pretrained(device=args.device, max_batch=max_batch, max_budget=64)
        prompts = [PROMPT] * args.requests
        run_clients(engine, prompts, 1, params, {"mode": "ar", "budget": 1})  # compile, capture
        runs = [run_clients(engine, prompts, 1, params, {"mode": "ar", "budget": 1}) for _ in range(3)]
        print(f"engine max_batch={max_batch}: decode tokens/s " + ", ".join(f"{r['decode_tokens_per_s']:.0f}" for r in runs)
              + f"; step ms {statistics.median(r['step_ms_mean'] for r in runs):.4f}; TTFT p50 ms "
              f"{statistics.median(r['ttft_p50_ms'] for r in runs):.3f}", flush=True)
        engine = None
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def raw_client(url: str, tokens: int, requests: int) -> list[float]:
    """Per-token ms (first event to the last token's) of `requests` streams, one after another."""
    import json

    host, port = url.split("//")[1].split(":")
    data = json.dumps(dict(model="ddtree-demo", prompt=PROMPT, max_tokens=tokens, temperature=0.0, stream=True,
                           ignore_eos=True, ddtree={"mode": "ar"})).encode()
    request = (f"POST /v1/completions HTTP/1.1\r\nhost: {host}\r\ncontent-type: application/json\r\n"
               f"content-length: {len(data)}\r\n\r\n").encode() + data
    sock = socket.create_connection((host, int(port)))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    per_token = []
    for _ in range(requests):
        sock.sendall(request)
        seen, first, last = b"", None, None
        while not seen.endswith(b"0\r\n\r\n"):
            chunk = sock.recv(65536)
            now = time.perf_counter()
            if b'"text"' in chunk:
                first, last = first or now, now
            seen += chunk
        per_token.append((last - first) / (tokens - 1) * 1e3)
    return per_token


def turn_report(since_ns: int) -> None:
    """Medians over the core's turns marked after since_ns."""
    marks = [(int(t), name) for t, name in (line.split() for line in open(LOG)) if int(t) >= since_ns]
    parts = {"step": [], "deliver": [], "send": [], "rest": [], "turn": []}
    last = {}
    for t, name in marks:
        if name == "step_in" and "send_out" in last and "step_in" in last:
            parts["rest"].append(t - last["send_out"])
            parts["turn"].append(t - last["step_in"])
        if name == "send_in" and "step_out" in last:
            parts["deliver"].append(t - last["step_out"])
        if name.endswith("_out") and name[:-4] + "_in" in last:
            parts[name[:-4]].append(t - last[name[:-4] + "_in"])
        last[name] = t
    print("the core's turns (median us): " + ", ".join(f"{k} {statistics.median(v) / 1e3:.1f} (n {len(v)})"
                                                     for k, v in parts.items() if v), flush=True)


def py_spy(pid: int, seconds: float) -> subprocess.Popen | None:
    exe = os.environ.get("PY_SPY") or shutil.which("py-spy")
    if exe is None:
        print("py-spy not found: no profile", flush=True)
        return None
    out = LOG + ".spy"
    return subprocess.Popen([exe, "record", "-p", str(pid), "-d", str(max(1, round(seconds))), "-r", "2000", "-f", "raw", "-o", out,
                             "--nonblocking", "--threads"], stdout=open(out + ".log", "w"), stderr=subprocess.STDOUT)


def spy_report(top: int = 25) -> None:
    """Own-time leaf frames of the scheduler thread's samples (py-spy raw: collapsed stacks)."""
    path = LOG + ".spy"
    if not os.path.exists(path):
        if os.path.exists(path + ".log"):
            print("py-spy wrote no profile:", open(path + ".log").read()[-400:])
        return
    leaves, total = {}, 0
    for line in open(path):
        stack, _, count = line.rstrip().rpartition(" ")
        if "Scheduler._run" not in stack:  # the scheduler thread's stacks
            continue
        total += int(count)
        leaf = stack.split(";")[-1].split(":")[0] + ")"  # the function and its file, any line
        leaves[leaf] = leaves.get(leaf, 0) + int(count)
    print(f"py-spy: the scheduler thread's {total} samples, by leaf frame:")
    for leaf, count in sorted(leaves.items(), key=lambda kv: -kv[1])[:top]:
        print(f"  {100 * count / max(total, 1):5.1f}%  {leaf}")


def server_side(args) -> None:
    from client_pool import ClientPool
    from serving_host_cost import serve

    from ddtree.cli import build_parser
    from ddtree.server.app import ServerConfig, create_app
    from ddtree.server.command import serving_facts
    from ddtree.server.engine_core import EngineCore

    serve_args = build_parser().parse_args(["serve", "--device", args.device, "--max-batch", str(args.max_batch),
                                            "--warm-modes", "ar"])
    core = EngineCore(functools.partial(traced_core_build, serve_args), serving_facts, max_queue=64)
    core.launch()
    url, server = serve(create_app(core, ServerConfig(model_name="ddtree-demo", default_mode="ar")))
    body = dict(model="ddtree-demo", prompt=PROMPT, max_tokens=args.tokens, temperature=0.0, stream=True,
                ignore_eos=True, ddtree={"mode": "ar"}, stream_options={"include_usage": True,
                                                                        "continuous_usage_stats": True})
    try:
        with ClientPool(1) as clients:
            clients.run(url, [body] * 2, 1)  # warm-up
            for attempt in range(3):
                since = time.perf_counter_ns()
                spy = py_spy(core.pid, args.py_spy) if args.py_spy and attempt == 1 else None
                records, wall, _ = clients.run(url, [body] * args.requests, 1)
                if spy is not None:
                    spy.wait(60)
                waited = sum(r["ttft"] for r in records)
                gaps = [g for r in records for g in r["token_gaps"]]
                print(f"server, httpx client: decode tokens/s {sum(r['tokens'] - 1 for r in records) / (wall - waited):.0f}"
                      f", token gap p50 ms {statistics.median(gaps) * 1e3:.4f}, TTFT p50 ms "
                      f"{statistics.median(r['ttft'] for r in records) * 1e3:.3f}", flush=True)
                time.sleep(0.6)  # the marks' writer flushes every 0.5 s
                turn_report(since)
            since = time.perf_counter_ns()
            per_token = raw_client(url, args.tokens, args.requests)
            print(f"server, raw socket client: per-token ms p50 {statistics.median(per_token):.4f} "
                  f"(decode tokens/s {1e3 / statistics.median(per_token):.0f})", flush=True)
            time.sleep(0.6)
            turn_report(since)
    finally:
        server.should_exit = True
        core.stop()
    spy_report()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--max-batch", type=int, default=64, help="the server's (serve_vs_engine: its largest c)")
    parser.add_argument("--py-spy", type=int, default=0, help="seconds of py-spy on the core (0: none)")
    parser.add_argument("--skip-engine", action="store_true")
    args = parser.parse_args()
    if not args.skip_engine:
        engine_side(args)
    server_side(args)


if __name__ == "__main__":
    main()
