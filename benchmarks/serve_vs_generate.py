"""One streamed request through `ddtree serve` beside `ddtree generate`, interleaved in one run.

    python benchmarks/serve_vs_generate.py --device cpu --rounds 5

A server of the demo pair is started once and kept running; then, per round and per mode, one
`ddtree generate` (a fresh process: its own statistics' tokens/s, from the prefill to the end) and
two streamed requests of the same prompt to the server (tokens over the request's whole time, as
the client sees it: HTTP, queueing and prefill included). The requests are made with curl, a
light client: a Python client on the same small machine takes CPU from the server.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import environment, markdown_table, write_results  # noqa: E402

PROMPT = "def fibonacci(n):"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def generate_speed(mode: str, new: int, device: str) -> float:
    """tokens/s by generate's own statistics."""
    out = subprocess.run([sys.executable, "-m", "ddtree", "generate", "--device", device, "--mode", mode,
                          "--max-new-tokens", str(new), "--json", PROMPT], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.splitlines()[-1])["stats"]["tokens_per_s"]


def serve_speed(port: int, mode: str, new: int) -> float:
    """tokens/s of one streamed request, over its whole time as curl measures it."""
    body = json.dumps({"model": "ddtree-demo", "prompt": PROMPT, "max_tokens": new, "temperature": 0, "stream": True,
                       "ignore_eos": True, "ddtree": {"mode": mode}})
    out = subprocess.run(["curl", "-s", "-N", "-w", "\n%{http_code} %{time_total}", "-H",
                          "content-type: application/json", "-d", body, f"http://127.0.0.1:{port}/v1/completions"],
                         capture_output=True, text=True, check=True)
    events, status = out.stdout.rsplit("\n", 1)
    code, seconds = status.split()
    streamed = sum(1 for line in events.splitlines() if line.startswith("data: {"))
    if code != "200" or "data: [DONE]" not in events or not streamed:
        raise RuntimeError(f"the request failed (HTTP {code}): {events[-300:]}")
    return new / float(seconds)


def start_server(port: int, device: str, max_batch: int, extra: tuple[str, ...] = ()) -> subprocess.Popen:
    """`ddtree serve` on the demo pair, once /health answers; its engine process's pid (from its
    start-up line) as .core_pid (None with --single-process)."""
    log = tempfile.TemporaryFile()
    proc = subprocess.Popen([sys.executable, "-m", "ddtree", "serve", "--device", device, "--port", str(port),
                             "--max-batch", str(max_batch), "--log-level", "warning", *extra],
                            stdout=subprocess.DEVNULL, stderr=log)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline and proc.poll() is None:
        ready = subprocess.run(["curl", "-sf", "-m", "2", f"http://127.0.0.1:{port}/health"], capture_output=True)
        if ready.returncode == 0:
            log.seek(0)
            core = re.search(r"engine process (\d+)", log.read().decode(errors="replace"))
            proc.core_pid = int(core.group(1)) if core else None
            return proc
        time.sleep(0.5)
    stop(proc)
    log.seek(0)
    why = f"exited with {proc.returncode}" if proc.returncode else "was not ready within 600 s"
    raise RuntimeError(f"the server {why}: {log.read().decode(errors='replace')[-2000:]}")


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--modes", nargs="+", default=["ar", "ddtree"])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--new", type=int, default=128)
    parser.add_argument("--max-batch", type=int, default=4)
    parser.add_argument("--out-dir", type=Path, default=None)
    args = parser.parse_args()
    if shutil.which("curl") is None:
        raise SystemExit("needs curl (the light client)")
    env = environment()
    port = free_port()
    server = start_server(port, args.device, args.max_batch)
    speeds: dict[str, dict[str, list[float]]] = {m: {"generate": [], "serve": []} for m in args.modes}
    try:
        for mode in args.modes:  # warm-up: the server's first request of each mode
            serve_speed(port, mode, args.new)
        for r in range(args.rounds):
            for mode in args.modes:
                speeds[mode]["generate"].append(generate_speed(mode, args.new, args.device))
                speeds[mode]["serve"] += [serve_speed(port, mode, args.new) for _ in range(2)]
                print(f"round {r + 1}: {mode} generate {speeds[mode]['generate'][-1]:.1f}, serve "
                      f"{speeds[mode]['serve'][-2]:.1f} {speeds[mode]['serve'][-1]:.1f}", flush=True)
    finally:
        stop(server)
    rows = []
    for mode, got in speeds.items():
        g, s = statistics.median(got["generate"]), statistics.median(got["serve"])
        rows.append({"mode": mode, "generate_median": g, "serve_median": s, "serve_over_generate": s / g, **got})
    payload = {"environment": env, "device": args.device, "new_tokens": args.new, "rounds": args.rounds,
               "omp_num_threads": os.environ.get("OMP_NUM_THREADS"), "cpu_cores": len(os.sched_getaffinity(0)),
               "rows": rows}
    table = (f"One streamed request of {args.new} tokens (the demo pair, temperature 0) through `ddtree serve` "
             f"beside `ddtree generate`, interleaved over {args.rounds} rounds on {payload['cpu_cores']} CPU cores "
             "(device " + args.device + "); medians in tokens/s.\n\n"
             + markdown_table(["mode", "generate", "serve", "serve / generate", "generate runs", "serve runs"],
                              [[r["mode"], f"{r['generate_median']:.1f}", f"{r['serve_median']:.1f}",
                                f"{r['serve_over_generate']:.3f}", " ".join(f"{v:.0f}" for v in r["generate"]),
                                " ".join(f"{v:.0f}" for v in r["serve"])] for r in rows]))
    md = write_results("serve_vs_generate", payload, table, args.out_dir)
    print(md.read_text())


if __name__ == "__main__":
    main()
