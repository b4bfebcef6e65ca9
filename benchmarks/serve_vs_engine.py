"""The same prompts through the engine and through `ddtree serve`, in one run on one device:
does the server decode at the engine's speed (issue 36)?

    python benchmarks/serve_vs_engine.py --concurrency 1 8 32 64 --modes ar,ddtree:16,ddtree:auto
    python benchmarks/serve_vs_engine.py --device cpu --concurrency 1 2 --modes ar --max-tokens 8 --requests 2
    python benchmarks/serve_vs_engine.py --api-server-counts 1 4   # one server, then one of 4 HTTP processes

First the engine, in this process: per concurrency c an Engine of max_batch c (the demo pair unless
--target / --drafter), and per mode, after a warm-up pass, the cell's prompts from c clients
(engine_clients.py: each adds its next prompt when its last request finished, as a server's c
clients keep c requests in flight). Then, with this process's engines gone, one `ddtree serve
--max-batch max(c)` on the same device, warmed with a few requests of each mode, and per (mode, c)
the same prompts from c concurrent streamed clients (benchmarks/serve_bench.py's client, spread over
--client-processes processes so that parsing the events is not the bottleneck: client_pool.py), for
each HTTP library in --clients (aiohttp by default, as vLLM's serving benchmark: its request and
event parsing cost less of the client's own time than httpx's; the bars are the first library's).
Both sides' decode tokens/s: the tokens after each request's first over the cell's wall time less
the clients' mean time to first token summed per client (the time each client waited for its
requests' first tokens). Each cell, engine and server alike, runs --repeats passes and reports its
median pass (the lower middle one of an even count): single passes of a cell moved by up to 2.4x on
one H100. With --burst, beside it, one pass of the engine's figure as this benchmark took it before (all prompts
added at once, the wall time of the same prompts at max_new_tokens = 1 taken off): it subtracted
prefills batched c at a time while the timed run prefilled arrivals a few at a time.

The JSON's `bars`: server_over_engine_min (the smallest ratio of the server's decode tokens/s to
the engine's over every cell) and ttft_gap_ms_c1 (the largest, over modes, of the server's median
time to first token at concurrency 1 less the engine's). Requests ignore EOS, so both sides make
max_tokens tokens per request. Each server cell also reports the CPU seconds over its wall time of
the busiest HTTP process (and of all of them), the engine-core process and the busiest client
process (near 1.0: that process ran the whole cell, the likely bottleneck).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import environment, markdown_table, write_results  # noqa: E402
from serve_bench import CLIENTS, client_version, load_prompts, make_bodies, parse_modes  # noqa: E402
from serve_vs_generate import free_port, start_server, stop  # noqa: E402
from client_pool import ClientPool, ServerCpu  # noqa: E402
from engine_clients import burst_decode_tokens_per_s, run_clients  # noqa: E402

from ddtree import Engine, SamplingParams  # noqa: E402


def engine_cells(args, prompts: list[str], modes) -> dict:
    """(mode label, c) -> the engine's cell: decode tokens/s from c clients in this process
    (engine_clients.py: the server's formula, the bars' figure), its TTFT p50 (add_request to the
    step that returned the first token), and the figure this benchmark reported before (all prompts
    added at once, their wall time at max_new_tokens = 1 taken off), one pass."""
    out = {}
    for c in args.concurrency:
        engine = Engine.from_pretrained(args.target, args.drafter, device=args.device, max_batch=c,
                                        max_budget=64)
        cell = cell_prompts(prompts, c, args.requests)
        params = SamplingParams(max_new_tokens=args.max_tokens, ignore_eos=True)
        for mode, budget in modes:
            kind = {"mode": mode, "budget": 1 if budget is None else budget}
            run_clients(engine, cell, c, params, kind)  # compile, capture, round costs
            runs = sorted((run_clients(engine, cell, c, params, kind) for _ in range(args.repeats)),
                          key=lambda run: run["decode_tokens_per_s"])
            run = runs[(len(runs) - 1) // 2]  # the median pass (the lower of two), as the server's
            burst = burst_decode_tokens_per_s(engine, cell, params, kind)[0] if args.burst else None
            out[(label(mode, budget), c)] = {
                "decode_tokens_per_s": run["decode_tokens_per_s"], "ttft_p50_ms": run["ttft_p50_ms"],
                "decode_tokens_per_s_runs": [r["decode_tokens_per_s"] for r in runs],
                "steps": run["steps"], "prefills": run["prefills"], "batch_mean": run["batch_mean"],
                "burst_decode_tokens_per_s": burst}
            print(f"engine {label(mode, budget)} c={c}: {out[(label(mode, budget), c)]}", flush=True)
        engine = None  # its memory back before the next engine (and the server)
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return out


def _server_run(clients: ClientPool, cpu: ServerCpu, url: str, bodies: list[dict], c: int) -> dict:
    """One pass of a server cell's requests from c streamed clients."""
    cpu.start()
    records, wall, client_cpu = clients.run(url, bodies, c)
    ok = [r for r in records if r["error"] is None and r["ttft"] is not None]
    waited = sum(r["ttft"] for r in ok) / c  # each client's wait for first tokens
    decode = sum(r["tokens"] - 1 for r in ok) / max(wall - waited, 1e-9)
    ttft = statistics.median(r["ttft"] for r in ok) * 1e3 if ok else None
    return {"decode_tokens_per_s": decode, "ttft_p50_ms": ttft, "errors": len(records) - len(ok), "wall_s": wall,
            "tokens": sum(r["tokens"] for r in ok), **cpu.fractions(wall), "client_cpu": client_cpu}


def cell_prompts(prompts: list[str], concurrency: int, requests: int | None) -> list[str]:
    count = requests or max(32, 16 * concurrency)  # at 4 c a c = 64 pass lasted about 0.3 s
    return [prompts[i % len(prompts)] for i in range(count)]


def label(mode: str, budget) -> str:
    return mode if budget is None else f"{mode} {budget}"


def server_cells(args, prompts: list[str], modes, api_servers: int) -> dict:
    """(client, mode label, c) -> the cell of a server of `api_servers` HTTP processes through each
    of args.clients: decode tokens/s, TTFT median, errors, and the CPU share of the busiest HTTP
    process (and of all of them), the engine core and the busiest client process over the cell."""
    import httpx

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = start_server(port, args.device, max(args.concurrency), ("--api-server-count", str(api_servers)))
    out = {}
    client_args = argparse.Namespace(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True, seed=None)
    try:
        model = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
        cpu = ServerCpu(server.pid, server.core_pid, other_http=True)
        for kind in args.clients:
            with ClientPool(args.client_processes, kind) as clients:
                for mode, budget in modes:
                    clients.run(url, make_bodies(client_args, prompts, mode, budget, 4, model, 0), 2)  # warm-up
                    for c in args.concurrency:
                        cell = cell_prompts(prompts, c, args.requests)
                        bodies = make_bodies(client_args, cell, mode, budget, len(cell), model, 0)
                        runs = [_server_run(clients, cpu, url, bodies, c) for _ in range(args.repeats)]
                        runs.sort(key=lambda run: run["decode_tokens_per_s"])
                        cell_out = runs[(len(runs) - 1) // 2]  # the median pass by decode tokens/s (the lower of two)
                        cell_out["errors"] = sum(run["errors"] for run in runs)  # any run's errors count
                        cell_out["decode_tokens_per_s_runs"] = [run["decode_tokens_per_s"] for run in runs]
                        out[(kind, label(mode, budget), c)] = cell_out
                        print(f"server ({api_servers} API, {kind}) {label(mode, budget)} c={c}: "
                              f"{cell_out['decode_tokens_per_s']:.1f} decode tokens/s, TTFT p50 {cell_out['ttft_p50_ms']} "
                              f"ms, CPU {cell_out}", flush=True)
    finally:
        stop(server)
    return out


def _rate(value) -> str:
    return "-" if value is None else f"{value:.1f}"


def _ms(value) -> str:
    return "-" if value is None else f"{value:.1f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default=None)
    parser.add_argument("--target", default=None, help="target directory (default: the demo pair's)")
    parser.add_argument("--drafter", default=None)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--modes", default="ar,ddtree:16,ddtree:auto", help="as serve_bench's --modes")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--requests", type=int, default=None, help="requests per cell (default max(32, 16 c))")
    parser.add_argument("--prompts", default=None, help="a prompts file (serve_bench.load_prompts)")
    parser.add_argument("--client-processes", type=int, default=4,
                        help="processes the streamed clients are spread over (one asyncio loop each)")
    parser.add_argument("--repeats", type=int, default=3,
                        help="passes per cell, engine and server alike: each reports its median pass")
    parser.add_argument("--burst", action="store_true",
                        help="also the engine's figure as taken before 2026-12-07 (two more engine passes a cell)")
    parser.add_argument("--clients", nargs="+", choices=CLIENTS, default=["aiohttp"],
                        help="the streamed clients' HTTP library, each over the same server (the bars are the first's)")
    parser.add_argument("--api-server-counts", type=int, nargs="+", default=[1],
                        help="one server per count (`ddtree serve --api-server-count`), one after another; the "
                             "bars are the last count's")
    parser.add_argument("--out-dir", type=Path, default=None)
    args = parser.parse_args()
    if args.repeats < 1:
        raise SystemExit(f"--repeats must be at least 1, got {args.repeats}")
    if args.target is not None or args.drafter is not None:
        raise SystemExit("--target / --drafter: the server side serves the demo pair only in this version")
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    env = environment()
    modes = parse_modes(args.modes, 16)
    prompts = load_prompts(args.prompts)
    engine = engine_cells(args, prompts, modes)
    rows = []
    for count in args.api_server_counts:
        for (kind, name, c), cell in server_cells(args, prompts, modes, count).items():
            mine = engine[(name, c)]
            rows.append({"mode": name, "concurrency": c, "api_servers": count, "client": kind,
                         **{f"engine_{k}": v for k, v in mine.items()}, **{f"server_{k}": v for k, v in cell.items()},
                         "server_over_engine": cell["decode_tokens_per_s"] / mine["decode_tokens_per_s"]})
    bars = {}
    for count in args.api_server_counts:  # the last count's are the bars
        mine = [r for r in rows if r["api_servers"] == count and r["client"] == args.clients[0]]
        gaps = [r["server_ttft_p50_ms"] - r["engine_ttft_p50_ms"] for r in mine if r["concurrency"] == 1
                and r["server_ttft_p50_ms"] is not None and r["engine_ttft_p50_ms"] is not None]
        bars.update({"server_over_engine_min": min(r["server_over_engine"] for r in mine),
                     "ttft_gap_ms_c1": max(gaps) if gaps else None, "api_servers": count, "client": args.clients[0]})
    payload = {"environment": env, "device": args.device, "max_tokens": args.max_tokens, "modes": args.modes,
               "repeats": args.repeats,
               "client_processes": args.client_processes, "clients": args.clients,
               "client_versions": {kind: client_version(kind) for kind in args.clients},
               "api_server_counts": args.api_server_counts,
               "concurrency": args.concurrency, "rows": rows, "bars": bars}
    table = (f"The demo pair on {args.device}: the same prompts ({args.max_tokens} tokens each, EOS ignored) from c "
             "clients through the engine in this process (max_batch = c) and through `ddtree serve` (streamed HTTP); "
             "decode tokens/s on both sides: the tokens after each request's first over the wall time less the "
             "clients' summed times to first token. ttft_gap_ms_c1: the largest, over modes, of the server's TTFT "
             "p50 at c = 1 less the engine's (the bars: the first client library's cells). 'engine, burst' (--burst): the "
             "engine's figure as this benchmark took it "
             "before 2026-12-07 (all prompts added at once, their prefill-only wall time taken off).\n\n"
             + "\n".join(f"- {k}: {v:.3f}" if isinstance(v, float) else f"- {k}: {'-' if v is None else v}"
                         for k, v in bars.items()) + "\n\n"
             + markdown_table(["mode", "c", "API servers", "client", "engine decode tokens/s", "server decode tokens/s",
                               "server / engine", "engine, burst", "TTFT p50 ms: engine / server", "errors",
                               "CPU: busiest HTTP (all HTTP) / core / client"],
                              [[r["mode"], r["concurrency"], r["api_servers"], r["client"],
                                f"{r['engine_decode_tokens_per_s']:.1f}",
                                f"{r['server_decode_tokens_per_s']:.1f}", f"{r['server_over_engine']:.3f}",
                                _rate(r["engine_burst_decode_tokens_per_s"]),
                                f"{_ms(r['engine_ttft_p50_ms'])} / {_ms(r['server_ttft_p50_ms'])}",
                                r["server_errors"], f"{r['server_http_cpu']:.2f} ({r['server_http_cpu_sum']:.2f}) / "
                                f"{r['server_core_cpu']:.2f} / "
                                f"{r['server_client_cpu']:.2f}"] for r in rows]))
    md = write_results("serve_vs_engine", payload, table, args.out_dir)
    print(md.read_text())


if __name__ == "__main__":
    main()
