"""A freshly started `ddtree serve` against the same server warmed (issue 22): does any request
wait for a compile or a capture?

    python benchmarks/serve_fresh.py --concurrency 1 8 32 --modes ar,chain,ddtree:16,ddtree:auto
    python benchmarks/serve_fresh.py --device cpu --concurrency 1 --modes ar --max-tokens 4 --requests 2

One `ddtree serve` on the demo pair (--serve-args passed on), timed from its start to its first
/health answer; then every cell (mode x concurrency: serve_bench's streamed clients, its default
prompts, EOS ignored) twice over: the first pass is the server's first traffic, no warm-up of
ours (each pass's client first reads /health once, so that the client library's own first-use
costs are not counted as the server's); the second finds every shape the first ran. Per cell the TTFT p50 / p99 of both passes
and the server's ddtree_eager_rounds / ddtree_round_graphs growth over the cell (/metrics: rounds
run without a graph, graphs captured; 0 on the CPU), and the TTFT of the cell's first-sent request
and its largest (a tail of one request, the server's first, or of many). The JSON's `bars`: fresh_over_warm_ttft_p99_max
(the largest ratio over the cells; the bar is 3) and eager_rounds_first_pass.
"""

from __future__ import annotations

import argparse
import asyncio
import shlex
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import environment, markdown_table, write_results  # noqa: E402
from serve_bench import (CLIENTS, load_prompts, make_bodies, open_client, parse_modes, run_cell,  # noqa: E402
                         summarize, warm_client)
from serve_vs_generate import free_port, start_server, stop  # noqa: E402

COUNTS = ("ddtree_eager_rounds", "ddtree_round_graphs")


def graph_counts(url: str) -> dict[str, float]:
    """The server's round-graph counts from /metrics (prometheus_client's own parser)."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{url}/metrics", timeout=30).text
    found = {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples}
    missing = [name for name in COUNTS if name not in found]
    if missing:
        raise RuntimeError(f"the server's /metrics has no {missing}: a server older than this benchmark")
    return {name: found[name] for name in COUNTS}


async def one_pass(url: str, args, prompts: list[str], modes, model: str) -> dict:
    """(mode label, c) -> the cell's serve_bench summary and its growth of COUNTS."""
    client_args = argparse.Namespace(max_tokens=args.max_tokens, temperature=args.temperature, ignore_eos=True,
                                     seed=0 if args.temperature > 0 else None)
    out = {}
    async with open_client(args.client, max(args.concurrency) + 4) as client:
        await warm_client(client, url)  # the client's first-use costs are not the fresh server's
        for mode, budget in modes:
            for c in args.concurrency:
                count = args.requests or max(16, 4 * c)
                before = graph_counts(url)
                records, wall = await run_cell(client, url, make_bodies(client_args, prompts, mode, budget, count,
                                                                        model, c), c)
                after = graph_counts(url)
                cell = summarize(mode, budget, c, records, wall)
                cell.update({name.removeprefix("ddtree_"): after[name] - before[name] for name in COUNTS})
                timed = [r for r in records if r["error"] is None and r["ttft"] is not None]
                if timed:  # is the tail one request (the server's first) or many?
                    first = min(timed, key=lambda r: r["sent"])
                    cell.update(ttft_first_sent_ms=round(first["ttft"] * 1e3, 2),
                                ttft_max_ms=round(max(r["ttft"] for r in timed) * 1e3, 2))
                out[(label(mode, budget), c)] = cell
                print(f"{label(mode, budget)} c={c}: TTFT p99 {cell['ttft_p99_ms']} ms, eager rounds "
                      f"{cell['eager_rounds']:.0f}, errors {cell['errors']}", flush=True)
    return out


def label(mode: str, budget) -> str:
    return mode if budget is None else f"{mode}:{budget}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default=None)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--modes", default="ar,chain,ddtree:16,ddtree:auto", help="as serve_bench's --modes")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--requests", type=int, default=None, help="requests per cell (default max(16, 4 c))")
    parser.add_argument("--serve-args", default="--warm-modes ar,chain,ddtree:16,ddtree:auto",
                        help="more `ddtree serve` flags, one string (the modes it warms at start-up among them)")
    parser.add_argument("--client", choices=CLIENTS, default="aiohttp", help="the streamed clients' HTTP library")
    parser.add_argument("--out-dir", type=Path, default=None)
    args = parser.parse_args()
    import torch
    import httpx

    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    modes = parse_modes(args.modes, 16)
    prompts = load_prompts(None)
    env = environment()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    started = time.perf_counter()
    server = start_server(port, args.device, max(args.concurrency), tuple(shlex.split(args.serve_args)))
    start_up_s = time.perf_counter() - started
    try:
        model = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
        at_ready = graph_counts(url)
        fresh = asyncio.run(one_pass(url, args, prompts, modes, model))
        warm = asyncio.run(one_pass(url, args, prompts, modes, model))
    finally:
        stop(server)
    rows = []
    for key, first in fresh.items():
        second = warm[key]
        ratio = (first["ttft_p99_ms"] / second["ttft_p99_ms"]
                 if first["ttft_p99_ms"] is not None and second["ttft_p99_ms"] else None)
        rows.append({"mode": key[0], "concurrency": key[1], "fresh": first, "warm": second,
                     "fresh_over_warm_ttft_p99": ratio})
    ratios = [r["fresh_over_warm_ttft_p99"] for r in rows if r["fresh_over_warm_ttft_p99"] is not None]
    bars = {"fresh_over_warm_ttft_p99_max": max(ratios) if ratios else None,
            "eager_rounds_first_pass": sum(r["fresh"]["eager_rounds"] for r in rows),
            "errors": sum(r["fresh"]["errors"] + r["warm"]["errors"] for r in rows)}
    payload = {"environment": env, "device": args.device, "modes": args.modes, "concurrency": args.concurrency,
               "client": args.client,
               "max_tokens": args.max_tokens, "temperature": args.temperature, "serve_args": args.serve_args,
               "start_up_s": start_up_s, "graph_counts_at_ready": at_ready, "rows": rows, "bars": bars}
    table = (f"`ddtree serve {args.serve_args}` on {args.device}, the demo pair: {start_up_s:.1f} s from its start to "
             f"its first /health answer ({at_ready['ddtree_round_graphs']:.0f} round graphs by then); each cell's "
             f"requests ({args.max_tokens} tokens, EOS ignored, temperature {args.temperature}) on the server's "
             "first traffic, then again. Eager rounds / graphs: the server's ddtree_eager_rounds / "
             "ddtree_round_graphs growth over the cell.\n\n"
             + "\n".join(f"- {k}: {'-' if v is None else f'{v:.3f}' if isinstance(v, float) else v}"
                         for k, v in bars.items()) + "\n\n"
             + markdown_table(["mode", "c", "TTFT p50 ms: fresh / warm", "TTFT p99 ms: fresh / warm", "p99 fresh / warm",
                               "TTFT of the first sent / max ms: fresh; warm",
                               "eager rounds: fresh / warm", "graphs captured: fresh / warm", "errors"],
                              [[r["mode"], r["concurrency"], f"{r['fresh']['ttft_p50_ms']} / {r['warm']['ttft_p50_ms']}",
                                f"{r['fresh']['ttft_p99_ms']} / {r['warm']['ttft_p99_ms']}",
                                "-" if r["fresh_over_warm_ttft_p99"] is None else f"{r['fresh_over_warm_ttft_p99']:.2f}",
                                f"{r['fresh'].get('ttft_first_sent_ms')} / {r['fresh'].get('ttft_max_ms')}; "
                                f"{r['warm'].get('ttft_first_sent_ms')} / {r['warm'].get('ttft_max_ms')}",
                                f"{r['fresh']['eager_rounds']:.0f} / {r['warm']['eager_rounds']:.0f}",
                                f"{r['fresh']['round_graphs']:.0f} / {r['warm']['round_graphs']:.0f}",
                                r["fresh"]["errors"] + r["warm"]["errors"]] for r in rows]))
    md = write_results("serve_fresh", payload, table, args.out_dir)
    print(md.read_text())


if __name__ == "__main__":
    main()
