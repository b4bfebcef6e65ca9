"""Shared benchmark plumbing: GPU timing, measured ceilings, and result files with provenance."""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import platform
import re
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Callable

import torch

ROOT = Path(__file__).resolve().parents[1]
RESULTS_DIR = ROOT / "benchmarks" / "results"


def environment() -> dict:
    """GPU name, library versions, date and the command line, recorded with every result."""
    import numpy
    import triton

    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "none (CPU)"
    return {
        "gpu": gpu,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": triton.__version__,
        "numpy": numpy.__version__,
        "python": platform.python_version(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": commit(),
        "command": " ".join([Path(sys.executable).name] + sys.argv),
    }


STAMP = ROOT / ".provenance.json"  # written by dev/stamp.py for a machine whose checkout has no usable .git
CODE = ("src", "benchmarks", "dev")  # the folders whose Python code a result depends on (with pyproject.toml)


def code_digest(root: Path | None = None) -> str:
    """sha256 over the Python files under CODE and pyproject.toml, by path and content: equal on
    two machines exactly when they run the same code."""
    root, digest = root or ROOT, hashlib.sha256()
    files = [root / "pyproject.toml"] + sorted(p for d in CODE for p in (root / d).rglob("*.py"))
    for path in files:
        if path.is_file():
            digest.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def commit() -> str:
    """The code's commit, "<hash>" or "<hash>+changes" (the tree differed from it): $DDTREE_COMMIT
    if set; else the stamp dev/stamp.py wrote, when the code is still what it stamped (a stale
    stamp is an error, never a wrong label); else git's HEAD; else "unknown"."""
    if os.environ.get("DDTREE_COMMIT"):
        return os.environ["DDTREE_COMMIT"]
    if STAMP.is_file():
        stamp = json.loads(STAMP.read_text())
        if stamp.get("digest") != code_digest():
            raise RuntimeError(f"{STAMP} describes other code than this checkout's: run dev/stamp.py again "
                               f"(or delete it)")
        return stamp["commit"]
    return git_commit()


def git_commit() -> str:
    """git's short HEAD, with "+changes" when tracked files differ from it; "unknown" without git."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+changes" if dirty else "")


def time_graph_us(fn: Callable[[], object], *, launches_per_graph: int = 20, trials: int = 30, warmup: int = 3) -> float:
    """Median GPU microseconds per call of `fn`, from CUDA-graph replays timed with CUDA events.

    Each trial replays a graph of `launches_per_graph` back-to-back calls, so launch overhead from
    the host is out of the number; the result is the median over trials divided by that count.
    """
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        for _ in range(launches_per_graph):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    samples = []
    for _ in range(trials):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e3 / launches_per_graph)
    return statistics.median(samples)


def time_events_us(fn: Callable[[], object], *, trials: int = 50, warmup: int = 5) -> float:
    """Median GPU microseconds of `fn` timed one call at a time with CUDA events."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(trials):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e3)
    return statistics.median(samples)


def measure_ceilings() -> dict:
    """Measured copy bandwidth (bytes read + written per second) and dense bf16 matmul rate."""
    n_bytes = 2 << 30
    src = torch.empty(n_bytes, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    copy_us = time_events_us(lambda: dst.copy_(src), trials=20)
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    mm_us = time_events_us(lambda: a @ b, trials=20)
    return {
        "copy_bandwidth_GBps": 2 * n_bytes / copy_us / 1e3,
        "bf16_matmul_TFLOPs": 2 * n**3 / mm_us / 1e6,
    }


def write_results(name: str, payload: dict, table_md: str, out_dir: Path | None = None) -> Path:
    """Write <name>-<gpu>.json and .md (provenance header + table) under out_dir; <gpu> is the
    environment's GPU name as a slug (e.g. nvidia-h200), so runs on different devices coexist."""
    if payload["environment"].get("commit", "unknown") == "unknown":
        raise RuntimeError("no commit to record with the results: run from a git checkout, set $DDTREE_COMMIT, "
                           "or stamp the checkout with dev/stamp.py before sending it to another machine")
    out_dir = Path(out_dir) if out_dir else RESULTS_DIR
    out_dir.mkdir(parents=True, exist_ok=True)
    name = f"{name}-{re.sub(r'[^a-z0-9]+', '-', payload['environment']['gpu'].lower()).strip('-')}"
    (out_dir / f"{name}.json").write_text(json.dumps(payload, indent=2) + "\n")
    env = payload["environment"]
    header = "\n".join(f"- {key}: {value}" for key, value in env.items())
    (out_dir / f"{name}.md").write_text(f"# {name}\n\n{header}\n\n{table_md}\n")
    return out_dir / f"{name}.md"


def markdown_table(headers: list[str], rows: list[list[object]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)
