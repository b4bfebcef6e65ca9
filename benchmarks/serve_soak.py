"""Soak test of `ddtree serve`: thousands of requests at high concurrency, mixed modes, budgets,
temperatures and endpoints, with clients that leave mid-stream and clients that send bad input.

    python benchmarks/serve_soak.py --requests 3000 --concurrency 64      # starts a demo-pair server
    python benchmarks/serve_soak.py --url http://127.0.0.1:8000 --pid 1234  # a server already running

What it checks (and reports): no 5xx at all; bad input answered 400; every completed request's
text equal to the same request served alone (sent one at a time first, mode ar: outputs do not
depend on the mode or the batch, greedy or seeded); every KV page free once it is over; the
server's resident memory sampled every second (its growth after the first quarter of the run is
the figure to watch); and /metrics counters that add up to what the clients saw. Writes
benchmarks/results/serve_soak-<device>.{json,md}. tests/server/test_soak.py runs a short form.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

PROMPTS = ["def add(a, b):", "for i in range(", "x = {", "import sys\n", "class Tree:", "print('", "while True:",
           "return [", "# sum of", "async def f():", "if x > 0:", "y = lambda z:", "def parse(text):\n    ",
           "with open(path) as f:", "try:\n    ", "numbers = [1, 2, 3]\n"]
BAD = [  # (raw body, what the server must answer)
    (b"{not json", 400), (b'{"prompt": "x", "max_tokens": 0}', 400), (b'{"prompt": "x", "temprature": 1}', 400),
    (b'{"prompt": "x", "ddtree": {"budget": 0}}', 400), (b'{"prompt": "x", "ddtree": {"mode": "beam"}}', 400),
    (b'{"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}', 400), (b'["a list"]', 400), (b'{"prompt": 5}', 400),
]


def make_cases(count: int, seed: int = 0, chat: bool = True, leave_share: float = 0.1, bad_share: float = 0.1) -> list[dict]:
    """`count` requests: a share of bad bodies, a share of streams the client leaves after its first
    event, the rest completions (and chats) of mixed mode, budget, temperature, stream or not."""
    rng = random.Random(seed)
    cases = []
    for i in range(count):
        roll = rng.random()
        if roll < bad_share:
            raw, status = BAD[i % len(BAD)]
            cases.append({"kind": "bad", "raw": raw, "expect": status})
            continue
        sampled = rng.random() < 0.4
        body = {"prompt": PROMPTS[rng.randrange(len(PROMPTS))], "max_tokens": rng.choice((4, 8, 12, 16)),
                "temperature": 0.8 if sampled else 0.0, "seed": rng.randrange(6) if sampled else None,
                "stream": rng.random() < 0.5,
                "ddtree": {"mode": rng.choice(("ar", "chain", "ddtree", "ddtree")), "budget": rng.choice((4, 8, "auto"))}}
        kind = "leave" if roll < bad_share + leave_share else "chat" if chat and rng.random() < 0.15 else "ok"
        if kind == "leave":
            body.update(stream=True, max_tokens=64)
        cases.append({"kind": kind, "body": body})
    return cases


def reference_key(body: dict) -> tuple:
    return (body["prompt"], body["max_tokens"], body["temperature"], body["seed"])


async def _completion(client: httpx.AsyncClient, url: str, case: dict) -> dict:
    kind = case["kind"]
    if kind == "bad":
        r = await client.post(f"{url}/v1/completions", content=case["raw"], headers={"content-type": "application/json"})
        return {"status": r.status_code}
    body = dict(case["body"])
    path = "/v1/completions"
    if kind == "chat":
        body["messages"] = [{"role": "user", "content": body.pop("prompt")}]
        path = "/v1/chat/completions"
    if not body["stream"]:
        r = await client.post(f"{url}{path}", json=body)
        out = r.json()
        if r.status_code != 200:
            return {"status": r.status_code, "error": out.get("error")}
        choice = out["choices"][0]
        text = choice["message"]["content"] if kind == "chat" else choice["text"]
        return {"status": 200, "text": text, "tokens": out["usage"]["completion_tokens"]}
    body["stream_options"] = {"include_usage": True}
    async with client.stream("POST", f"{url}{path}", json=body) as r:
        if r.status_code != 200:
            return {"status": r.status_code, "error": json.loads(await r.aread()).get("error")}
        text, tokens, errors = "", None, []
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                errors.append(event["error"])
                continue
            if kind == "leave":
                return {"status": 499}  # leave after the first event: the server must abort it
            if event.get("usage") and not event["choices"]:
                tokens = event["usage"]["completion_tokens"]
            for choice in event["choices"]:
                text += (choice["delta"].get("content") or "") if kind == "chat" else choice["text"]
        return {"status": 500 if errors else 200, "text": text, "tokens": tokens, "error": errors[0] if errors else None}


async def run_cases(url: str, cases: list[dict], concurrency: int, headers: dict | None = None) -> list[dict]:
    limit = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=httpx.Timeout(300.0), headers=headers,
                                 limits=httpx.Limits(max_connections=concurrency + 8)) as client:
        async def one(case):
            async with limit:
                return await _completion(client, url, case)
        return await asyncio.gather(*(one(c) for c in cases))


def references(url: str, cases: list[dict], headers: dict | None = None) -> dict:
    """Each distinct completion, served alone (one at a time, mode ar, not streamed)."""
    out = {}
    with httpx.Client(timeout=300, headers=headers) as client:
        for case in cases:
            if case["kind"] not in ("ok", "chat"):
                continue
            key = (case["kind"],) + reference_key(case["body"])
            if key in out:
                continue
            body = {**case["body"], "stream": False, "ddtree": {"mode": "ar"}}
            path = "/v1/completions"
            if case["kind"] == "chat":
                body["messages"] = [{"role": "user", "content": body.pop("prompt")}]
                path = "/v1/chat/completions"
            r = client.post(f"{url}{path}", json=body)
            r.raise_for_status()
            choice = r.json()["choices"][0]
            out[key] = choice["message"]["content"] if case["kind"] == "chat" else choice["text"]
    return out


def check(cases: list[dict], results: list[dict], refs: dict) -> dict:
    """The run's figures: statuses, 5xx, bad input not refused, texts unlike served alone."""
    statuses: dict[str, int] = {}
    mismatches, unrefused = [], 0
    for case, res in zip(cases, results):
        statuses[str(res["status"])] = statuses.get(str(res["status"]), 0) + 1
        if case["kind"] == "bad" and res["status"] != case["expect"]:
            unrefused += 1
        if case["kind"] in ("ok", "chat") and res["status"] == 200:
            want = refs[(case["kind"],) + reference_key(case["body"])]
            if res["text"] != want:
                mismatches.append({"body": case["body"], "got": res["text"], "want": want})
    return {"requests": len(cases), "statuses": statuses,
            "server_errors": sum(n for s, n in statuses.items() if s.startswith("5")),
            "bad_input_not_refused": unrefused, "mismatches": len(mismatches), "mismatch_examples": mismatches[:3],
            "completed_tokens": sum(r.get("tokens") or 0 for c, r in zip(cases, results) if r["status"] == 200)}


def counters(metrics_text: str) -> dict:
    """From /metrics: finished requests per endpoint (all statuses) and generated tokens."""
    from prometheus_client.parser import text_string_to_metric_families

    out = {"/v1/completions": 0.0, "/v1/chat/completions": 0.0, "generated_tokens": 0.0}
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            if sample.name == "ddtree_requests_total" and sample.labels.get("endpoint") in out:
                out[sample.labels["endpoint"]] += sample.value
            elif sample.name == "ddtree_generated_tokens_total":
                out["generated_tokens"] = sample.value
    return out


def counters_add_up(cases: list[dict], results: list[dict], before: dict, after: dict) -> dict:
    """What /metrics counted against what the clients saw: requests per endpoint, and generated
    tokens at least those of the completed requests (clients that left took some too)."""
    sent = {"/v1/completions": 0, "/v1/chat/completions": 0}
    for case in cases:
        sent["/v1/chat/completions" if case["kind"] == "chat" else "/v1/completions"] += 1
    completed = sum(r.get("tokens") or 0 for r in results if r["status"] == 200)
    generated = after["generated_tokens"] - before["generated_tokens"]
    counted = {k: after[k] - before[k] for k in sent}
    return {"requests_sent": sent, "requests_counted": counted, "generated_tokens_counted": generated,
            "completed_tokens_seen": completed, "ok": counted == sent and generated >= completed}


def rss_mib(pid: int) -> float:
    """Resident memory of a process (Linux /proc), MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default=None, help="a running server (default: start one with the demo pair)")
    parser.add_argument("--pid", type=int, default=None, help="the running server's pid, for its memory")
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--serve-args", default="--max-batch 32", help="extra `ddtree serve` arguments")
    parser.add_argument("--out-dir", type=Path, default=None)
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from common import environment, markdown_table, write_results

    env = environment()
    proc = None
    if args.url is None:
        port = 8000 + os.getpid() % 1000
        proc = subprocess.Popen([sys.executable, "-m", "ddtree", "serve", "--port", str(port), "--log-level", "warning",
                                 *args.serve_args.split()], stderr=subprocess.PIPE, text=True)
        args.url, args.pid = f"http://127.0.0.1:{port}", proc.pid
        while True:
            try:
                httpx.get(f"{args.url}/health", timeout=2)
                break
            except httpx.TransportError:
                if proc.poll() is not None:
                    raise SystemExit(proc.stderr.read())
                time.sleep(0.5)
    try:
        cases = make_cases(args.requests, chat=httpx.get(f"{args.url}/health").json().get("chat_template", False))
        start = time.perf_counter()
        refs = references(args.url, cases)
        print(f"{len(refs)} references served alone in {time.perf_counter() - start:.0f} s", flush=True)
        samples, done = [], threading.Event()

        def sample():
            while not done.is_set():
                samples.append((time.perf_counter(), rss_mib(args.pid) if args.pid else None))
                done.wait(1.0)

        sampler = threading.Thread(target=sample, daemon=True)
        before = counters(httpx.get(f"{args.url}/metrics").text)
        start = time.perf_counter()
        sampler.start()
        results = asyncio.run(run_cases(args.url, cases, args.concurrency))
        seconds = time.perf_counter() - start
        done.set()
        sampler.join()
        time.sleep(1.0)
        health = httpx.get(f"{args.url}/health").json()
        report = check(cases, results, refs)
        report["metrics"] = counters_add_up(cases, results, before, counters(httpx.get(f"{args.url}/metrics").text))
        memory = [m for _, m in samples if m is not None]
        quarter = memory[len(memory) // 4] if memory else None
        report.update(seconds=seconds, concurrency=args.concurrency, health_after=health,
                      pages_leaked=health["pages_total"] - health["pages_free"],
                      rss_mib_first=memory[0] if memory else None, rss_mib_after_first_quarter=quarter,
                      rss_mib_last=memory[-1] if memory else None,
                      rss_growth_after_first_quarter_mib=None if quarter is None else memory[-1] - quarter,
                      rss_samples=[round(m, 1) for m in memory])
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(60)
    payload = {"environment": env, "url": args.url, "serve_args": args.serve_args, "report": report}
    rows = [[k, v] for k, v in report.items() if k not in ("mismatch_examples", "health_after", "rss_samples")]
    md = write_results("serve_soak", payload, markdown_table(["figure", "value"], rows), args.out_dir)
    print(md.read_text())


if __name__ == "__main__":
    main()
