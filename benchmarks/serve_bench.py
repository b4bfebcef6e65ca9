"""Serving benchmark of a running `ddtree serve`, over HTTP only: throughput and latency per
decoding mode and client concurrency.

It starts nothing: point it at a server (--url). For every mode (sent per request as the
`ddtree: {mode, budget}` extra) and every concurrency level it sends --requests streamed
completions from that many concurrent clients (after a few warm-up requests per mode) and
measures, per request, from the moment the request is sent:

- TTFT: time to the first streamed chunk with text;
- ITL (inter-token latency): each later chunk's gap to the previous chunk, spread evenly over the
  tokens it carries (a round commits several tokens at once; the count comes from the chunk's
  usage, stream_options.continuous_usage_stats), percentiles over all tokens of the cell;
- chunk gap: the same gaps per chunk (what a reader sees between updates);
- end-to-end latency; and per cell output tokens/s and requests/s over the cell's wall time, and
  the mean acceptance length the server reports (usage.ddtree).

Writes <name>-<gpu>.json and .md under --out-dir (GPU name from --gpu-name or the server's
/health; the server's library versions, this client's, the date and the command line).

    python benchmarks/serve_bench.py --url http://127.0.0.1:8000 --concurrency 1,8,32 \
        --modes ar,chain,ddtree:16,ddtree:auto --max-tokens 128

A mode is ar, chain or ddtree[:budget] (a number or auto; bare ddtree sends --budget).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import platform
import re
import statistics
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS_DIR, commit  # noqa: E402

DEFAULT_PROMPTS = [  # Python openings, what the demo pair (a small Python coder) is for
    "def fibonacci(n):", "import os\n\ndef list_files(path):", "class Stack:\n    def __init__(self):",
    "def quicksort(items):", "import json\n\ndef load_config(path):", "def is_prime(n: int) -> bool:",
    "from collections import Counter\n\ndef top_words(text, k):", "def binary_search(items, target):",
    "class LinkedList:", "def read_csv(path):\n    rows = []", "import re\n\ndef slugify(title):",
    "def merge_sorted(a, b):", "async def fetch_all(urls):", "def flatten(nested):",
    "class Matrix:\n    def __init__(self, rows):", "def parse_args(argv=None):",
]


def load_prompts(path: str | None) -> list[str]:
    """Prompts from a .jsonl file ({"prompt": ...} per line), a .json list of strings, or a text
    file with one prompt per line; the built-in Python openings without a file."""
    if path is None:
        return list(DEFAULT_PROMPTS)
    text = Path(path).read_text()
    if path.endswith(".jsonl"):
        return [json.loads(line)["prompt"] for line in text.splitlines() if line.strip()]
    if path.endswith(".json"):
        return [str(p) for p in json.loads(text)]
    return [line for line in text.splitlines() if line.strip()]


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0..100) by linear interpolation; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


CLIENTS = ("aiohttp", "httpx")  # aiohttp, as vLLM's serving benchmark: less of the client's own time in TTFT


@contextlib.asynccontextmanager
async def open_client(kind: str, connections: int, timeout_s: float = 600.0):
    """An HTTP client session of `kind` (CLIENTS) for `connections` streams at once; timeout_s bounds
    each read (a connection 30 s)."""
    if kind == "aiohttp":
        import aiohttp

        # timeout_s per read, as httpx's: a long stream is not cut while it keeps coming
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_connect=30.0,
                                                                       sock_read=timeout_s),
                                         connector=aiohttp.TCPConnector(limit=connections)) as session:
            yield session
    elif kind == "httpx":
        limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
        async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=30.0), limits=limits) as client:
            yield client
    else:
        raise ValueError(f"client must be one of {', '.join(CLIENTS)}, got {kind!r}")


@contextlib.asynccontextmanager
async def _request(client, method: str, url: str, body: dict | None = None):
    """One request (a JSON `body` if any) with either client: (status, an async iterator of the
    response's lines without their line ends, a coroutine function reading the rest as text)."""
    if isinstance(client, httpx.AsyncClient):
        async with client.stream(method, url, json=body) as r:
            async def text() -> str:
                return (await r.aread()).decode(errors="replace")

            yield r.status_code, r.aiter_lines(), text
        return

    async with client.request(method, url, json=body) as r:
        async def lines():
            async for line in r.content:
                yield line.decode().rstrip("\r\n")

        async def text() -> str:
            return (await r.read()).decode(errors="replace")

        yield r.status, lines(), text


async def warm_client(client, url: str) -> None:
    """One streamed read of the server's /health through `client`: the library's own first-use costs
    (its connection, lazily imported parts) paid before anything is timed, and nothing of the
    server's generation path run."""
    async with _request(client, "GET", f"{url}/health") as (_, lines, _text):
        async for _ in lines:
            pass


def _client_errors() -> tuple[type, ...]:
    try:
        import aiohttp
    except ImportError:
        return (httpx.HTTPError,)
    return (httpx.HTTPError, aiohttp.ClientError)


async def one_request(client, url: str, body: dict) -> dict:
    """Send one streamed completion (client: open_client's aiohttp or httpx session); returns its
    timings (seconds), token count and usage, or an error."""
    sent = time.perf_counter()
    record = {"ttft": None, "token_gaps": [], "chunk_gaps": [], "tokens": 0, "usage": None, "error": None,
              "sent": sent}
    last, seen = None, 0
    try:
        async with _request(client, "POST", f"{url}/v1/completions", body) as (status, lines, text):
            if status != 200:
                record["error"] = f"HTTP {status}: {(await text())[:200]}"
                return record
            async for line in lines:
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                now = time.perf_counter()
                event = json.loads(line[6:])
                if "error" in event:
                    record["error"] = event["error"].get("message")
                    continue
                usage = event.get("usage")
                if not event["choices"]:  # the include_usage chunk
                    record["usage"] = usage
                    continue
                count = (usage or {}).get("completion_tokens", seen) - seen
                seen += count
                if count <= 0 and not event["choices"][0].get("text"):
                    continue
                if last is None:
                    record["ttft"] = now - sent
                else:
                    gap = now - last
                    record["chunk_gaps"].append(gap)
                    record["token_gaps"] += [gap / max(count, 1)] * max(count, 1)
                last = now
    except (*_client_errors(), json.JSONDecodeError, asyncio.TimeoutError) as err:
        record["error"] = f"{type(err).__name__}: {err}"
    record["tokens"] = seen
    record["latency"] = time.perf_counter() - sent
    return record


async def run_cell(client, url: str, bodies: list[dict], concurrency: int) -> tuple[list[dict], float]:
    """All bodies through `concurrency` concurrent clients; (records, wall seconds)."""
    queue: asyncio.Queue = asyncio.Queue()
    for body in bodies:
        queue.put_nowait(body)
    records: list[dict] = []

    async def worker():
        while not queue.empty():
            records.append(await one_request(client, url, queue.get_nowait()))

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return records, time.perf_counter() - start


def summarize(mode: str, budget: int | str | None, concurrency: int, records: list[dict], wall: float) -> dict:
    ok = [r for r in records if r["error"] is None]
    ms = lambda v: None if v is None else round(v * 1e3, 2)  # noqa: E731
    tokens = sum(r["tokens"] for r in ok)
    token_gaps = [g for r in ok for g in r["token_gaps"]]
    chunk_gaps = [g for r in ok for g in r["chunk_gaps"]]
    accept = [r["usage"]["ddtree"]["mean_acceptance_length"] for r in ok if r["usage"] and "ddtree" in r["usage"]]
    ttft = [r["ttft"] for r in ok if r["ttft"] is not None]
    return {
        "mode": mode, "budget": budget, "concurrency": concurrency, "requests": len(records),
        "errors": len(records) - len(ok), "first_error": next((r["error"] for r in records if r["error"]), None),
        "wall_s": round(wall, 3), "output_tokens": tokens, "output_tokens_per_s": round(tokens / wall, 2),
        "requests_per_s": round(len(ok) / wall, 3),
        "ttft_p50_ms": ms(percentile(ttft, 50)), "ttft_p99_ms": ms(percentile(ttft, 99)),
        "itl_p50_ms": ms(percentile(token_gaps, 50)), "itl_p99_ms": ms(percentile(token_gaps, 99)),
        "chunk_gap_p50_ms": ms(percentile(chunk_gaps, 50)), "chunk_gap_p99_ms": ms(percentile(chunk_gaps, 99)),
        "tokens_per_chunk": round(tokens / max(1, len(chunk_gaps) + len(ttft)), 2),
        "latency_p50_ms": ms(percentile([r["latency"] for r in ok], 50)),
        "mean_acceptance_length": round(statistics.fmean(accept), 3) if accept else None,
    }


def parse_modes(text: str, budget) -> list[tuple[str, int | str | None]]:
    """--modes as (mode, budget) pairs: "ar", "chain", "ddtree" (with `budget`) or "ddtree:N" /
    "ddtree:auto"; a ValueError naming the entry that is none of these."""
    modes = []
    for entry in text.split(","):
        mode, _, value = entry.partition(":")
        if mode not in ("ar", "chain", "ddtree") or (value and mode != "ddtree"):
            raise ValueError(f"--modes entry {entry!r}: need ar, chain, ddtree or ddtree:BUDGET")
        if mode != "ddtree":
            modes.append((mode, None))
            continue
        value = value or str(budget)
        if value != "auto" and not (value.isdigit() and int(value) > 0):
            raise ValueError(f"--modes entry {entry!r}: a budget is auto or an int > 0")
        modes.append((mode, value if value == "auto" else int(value)))
    return modes


def make_bodies(args, prompts: list[str], mode: str, budget, count: int, model: str, offset: int) -> list[dict]:
    bodies = []
    for i in range(count):
        body = {"model": model, "prompt": prompts[(offset + i) % len(prompts)], "max_tokens": args.max_tokens,
                "temperature": args.temperature, "stream": True, "ignore_eos": args.ignore_eos,
                "stream_options": {"include_usage": True, "continuous_usage_stats": True},
                "ddtree": {"mode": mode, **({"budget": budget} if budget is not None else {})}}
        if args.seed is not None:
            body["seed"] = args.seed + offset + i
        bodies.append(body)
    return bodies


async def bench(args) -> dict:
    prompts = load_prompts(args.prompts)
    health = httpx.get(f"{args.url}/health", timeout=30).json()
    model = args.model or httpx.get(f"{args.url}/v1/models", timeout=30).json()["data"][0]["id"]
    async with open_client(args.client, max(args.concurrency) + 4, args.timeout) as client:
        results = []
        for mode, budget in args.modes:
            warm, _ = await run_cell(client, args.url, make_bodies(args, prompts, mode, budget, args.warmup, model, 0),
                                     max(1, min(args.warmup, 4)))
            if any(r["error"] for r in warm):
                print(f"warm-up of {mode} failed: {next(r['error'] for r in warm if r['error'])}", file=sys.stderr)
            for concurrency in args.concurrency:
                count = args.requests or max(16, 4 * concurrency)
                bodies = make_bodies(args, prompts, mode, budget, count, model, offset=concurrency)
                records, wall = await run_cell(client, args.url, bodies, concurrency)
                row = summarize(mode, budget, concurrency, records, wall)
                print(json.dumps(row), flush=True)
                results.append(row)
    gpu = args.gpu_name or health.get("gpu") or health.get("device_name") or "unknown"
    environment = {
        "gpu": gpu, "server_model": model, "server_device": health.get("device"), "server_dtype": health.get("dtype"),
        "server_max_batch": health.get("max_batch"), "server_num_pages": health.get("num_pages"),
        "server_versions": health.get("versions"), "client_python": platform.python_version(),
        "client": args.client, "client_version": client_version(args.client),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": commit(),
        "command": " ".join([Path(sys.executable).name] + sys.argv),
    }
    return {"environment": environment, "args": vars(args), "results": results}


def client_version(kind: str) -> str:
    if kind == "aiohttp":
        import aiohttp

        return aiohttp.__version__
    return httpx.__version__


def markdown(payload: dict) -> str:
    args = payload["args"]
    head = ["mode", "budget", "concurrency", "requests", "errors", "tokens/s", "requests/s", "TTFT p50 ms",
            "TTFT p99 ms", "ITL p50 ms", "ITL p99 ms", "chunk gap p50 ms", "tokens/chunk", "mean accept"]
    keys = ["mode", "budget", "concurrency", "requests", "errors", "output_tokens_per_s", "requests_per_s",
            "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms", "chunk_gap_p50_ms", "tokens_per_chunk",
            "mean_acceptance_length"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in payload["results"]:
        lines.append("| " + " | ".join("-" if row[k] is None else str(row[k]) for k in keys) + " |")
    note = (f"Streamed /v1/completions, {args['max_tokens']} new tokens per request (ignore_eos "
            f"{args['ignore_eos']}), temperature {args['temperature']}. TTFT: send to first text chunk. ITL: "
            "gap between chunks spread over the tokens of the later chunk, percentiles over tokens; chunk gap: "
            "per chunk. tokens/s and requests/s over each cell's wall time.")
    return note + "\n\n" + "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="the server (no /v1)")
    parser.add_argument("--concurrency", default="1,8,32", help="comma-separated client concurrency levels")
    parser.add_argument("--modes", default="ar,chain,ddtree", help="comma-separated: ar, chain, ddtree, "
                        "ddtree:BUDGET (a number or auto)")
    parser.add_argument("--budget", default="64", help="tree budget sent with a bare ddtree (a number or auto)")
    parser.add_argument("--requests", type=int, default=0, help="requests per cell (0: max(16, 4 x concurrency))")
    parser.add_argument("--warmup", type=int, default=4, help="unmeasured requests before each mode")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=None, help="per-request seeds seed, seed + 1, ...")
    parser.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                        help="generate exactly --max-tokens tokens (default on)")
    parser.add_argument("--prompts", default=None, help=".jsonl ({'prompt': ...}), .json list, or one per line")
    parser.add_argument("--model", default=None, help="model id (default: the server's first in /v1/models)")
    parser.add_argument("--gpu-name", default=None, help="GPU name to record (default: the server's /health)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds a read of a response may wait")
    parser.add_argument("--client", choices=CLIENTS, default="aiohttp",
                        help="the HTTP client library (aiohttp, as vLLM's benchmark; httpx, as OpenAI's SDK)")
    parser.add_argument("--name", default="serve_bench", help="results file name")
    parser.add_argument("--out-dir", default=str(RESULTS_DIR))
    args = parser.parse_args()
    args.url = args.url.rstrip("/")
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    try:
        args.modes = parse_modes(args.modes, args.budget)
    except ValueError as err:
        parser.error(str(err))
    if commit() == "unknown":
        parser.error("no commit to record with the results: run from a git checkout or stamp it (dev/stamp.py)")
    payload = asyncio.run(bench(args))
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    name = f"{args.name}-{re.sub(r'[^a-z0-9]+', '-', payload['environment']['gpu'].lower()).strip('-')}"
    (out / f"{name}.json").write_text(json.dumps(payload, indent=2) + "\n")
    header = "\n".join(f"- {k}: {v}" for k, v in payload["environment"].items())
    (out / f"{name}.md").write_text(f"# {name}\n\n{header}\n\n{markdown(payload)}\n")
    print("wrote", out / f"{name}.md")


if __name__ == "__main__":
    main()
