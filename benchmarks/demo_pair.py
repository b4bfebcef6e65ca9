"""The demo pair's report: held-out perplexity of the target, mean acceptance length of `chain`
and `ddtree` at several budgets (temperature 0 and 1) on held-out prompts, greedy equality with
`ar`, and end-to-end tokens/s with the speedup against `ar`.

    python benchmarks/demo_pair.py                       # the shipped pair, on CUDA when present
    python benchmarks/demo_pair.py --device cpu --speed-prompts 4 --acceptance-prompts 0

Prompts: benchmarks/data/demo_prompts.jsonl (training/prompts.py, held-out files only).
Perplexity: --heldout DATA/heldout.jsonl from training/corpus.py (skipped without it).
Writes benchmarks/results/demo_pair-<device>.{json,md,png}.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import environment, markdown_table, write_results  # noqa: E402

from ddtree import Engine  # noqa: E402

PROMPTS = Path(__file__).resolve().parent / "data" / "demo_prompts.jsonl"


def pooled_acceptance(outs) -> float:
    """Tokens committed per round over all rounds of all requests (the paper's tau)."""
    rounds = sum(len(o.stats.acceptance_lengths) for o in outs)
    return sum(sum(o.stats.acceptance_lengths) for o in outs) / max(1, rounds)


def first_divergence(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


@torch.no_grad()
def perplexity(engine: Engine, heldout: Path, max_tokens: int, window: int) -> dict:
    """exp(mean next-token cross-entropy) over disjoint windows of the held-out files' tokens."""
    eot = engine.tokenizer.eos_token_id
    ids: list[int] = []
    with open(heldout) as f:
        for line in f:
            ids += engine.tokenizer(json.loads(line)["text"])["input_ids"] + [eot]
            if len(ids) > max_tokens:
                break
    tokens = torch.tensor(ids[: max_tokens + 1], device=engine.device)
    total, count = 0.0, 0
    for start in range(0, len(tokens) - window, window):
        rows = tokens[start : start + window + 1][None]
        logits = engine.target.logits(rows[:, :-1])
        total += float(torch.nn.functional.cross_entropy(logits[0], rows[0, 1:], reduction="sum"))
        count += window
    return {"tokens": count, "loss": total / count, "perplexity": math.exp(total / count)}


def acceptance(engine, prompts, args) -> list[dict]:
    rows = []
    for temperature in args.temperatures:
        seeds = list(range(len(prompts)))
        ar = engine.generate(prompts, args.max_new_tokens, mode="ar", temperature=temperature, seed=seeds)
        configs = [("chain", None)] + [("ddtree", b) for b in args.budgets]
        for mode, budget in configs:
            start = time.perf_counter()
            outs = engine.generate(prompts, args.max_new_tokens, mode=mode, budget=budget or 1,
                                   temperature=temperature, seed=seeds)
            seconds = time.perf_counter() - start
            divergences = [first_divergence(o.token_ids, a.token_ids) for o, a in zip(outs, ar)]
            diverged = [d for d in divergences if d is not None]
            rows.append({
                "temperature": temperature, "mode": mode, "budget": budget, "prompts": len(prompts),
                "mean_acceptance_length": pooled_acceptance(outs),
                "mean_of_request_means": statistics.mean(o.stats.mean_acceptance_length for o in outs),
                "equal_to_ar": sum(d is None for d in divergences),
                "median_first_divergence": statistics.median(diverged) if diverged else None,
                "batch_seconds": seconds})
            print(f"T={temperature} {mode:6s} budget {str(budget):>4s}: acceptance {rows[-1]['mean_acceptance_length']:.2f}, "
                  f"equal to ar {rows[-1]['equal_to_ar']}/{len(prompts)}", flush=True)
    return rows


def speed(engine, prompts, args) -> list[dict]:
    """Batch size 1, one prompt at a time: generated tokens over wall time, per mode."""
    rows = []
    configs = [("ar", None), ("chain", None)] + [("ddtree", b) for b in args.budgets]
    for mode, budget in configs:
        engine.generate(prompts[:1], 16, mode=mode, budget=budget or 1)  # warm-up: kernels compiled for this shape
        tokens, seconds, taus = 0, 0.0, []
        for prompt in prompts:
            if engine.device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            out = engine.generate([prompt], args.max_new_tokens, mode=mode, budget=budget or 1, temperature=0.0)[0]
            seconds += time.perf_counter() - start
            tokens += len(out.token_ids)
            taus += out.stats.acceptance_lengths
        rows.append({"mode": mode, "budget": budget, "prompts": len(prompts), "tokens": tokens, "seconds": seconds,
                     "tokens_per_s": tokens / seconds, "mean_acceptance_length": sum(taus) / max(1, len(taus))})
    base = rows[0]["tokens_per_s"]
    for row in rows:
        row["speedup_vs_ar"] = row["tokens_per_s"] / base
        print(f"speed {row['mode']:6s} budget {str(row['budget']):>4s}: {row['tokens_per_s']:.1f} tokens/s, "
              f"{row['speedup_vs_ar']:.2f}x ar", flush=True)
    return rows


def plot(payload: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for temperature, color in zip(sorted({r["temperature"] for r in payload["acceptance"]}), ("tab:blue", "tab:orange")):
        rows = [r for r in payload["acceptance"] if r["temperature"] == temperature]
        tree = [r for r in rows if r["mode"] == "ddtree"]
        left.plot([r["budget"] for r in tree], [r["mean_acceptance_length"] for r in tree], "o-", color=color,
                  label=f"ddtree, T={temperature:g}")
        chain = [r for r in rows if r["mode"] == "chain"]
        if chain:
            left.axhline(chain[0]["mean_acceptance_length"], color=color, linestyle="--", label=f"chain, T={temperature:g}")
    left.set_xscale("log", base=2)
    left.set_xlabel("tree budget (nodes)")
    left.set_ylabel("mean acceptance length (tokens / round)")
    left.set_title(f"acceptance on {payload['acceptance'][0]['prompts'] if payload['acceptance'] else 0} held-out prompts")
    tree = [r for r in payload["speed"] if r["mode"] == "ddtree"]
    right.plot([r["budget"] for r in tree], [r["speedup_vs_ar"] for r in tree], "o-", color="tab:green", label="ddtree")
    chain = [r for r in payload["speed"] if r["mode"] == "chain"]
    if chain:
        right.axhline(chain[0]["speedup_vs_ar"], color="tab:green", linestyle="--", label="chain")
    right.axhline(1.0, color="gray", linewidth=0.8)
    right.set_xscale("log", base=2)
    right.set_xlabel("tree budget (nodes)")
    right.set_ylabel("speedup over ar (batch 1, tokens/s)")
    right.set_title(f"end to end on {payload['environment']['gpu']}")
    for ax in (left, right):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", help="default: the shipped demo pair")
    parser.add_argument("--drafter")
    parser.add_argument("--prompts", type=Path, default=PROMPTS)
    parser.add_argument("--device", default=None)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--budgets", type=int, nargs="+", default=[8, 16, 32, 64, 128])
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    parser.add_argument("--acceptance-prompts", type=int, default=None, help="default: all (0 skips)")
    parser.add_argument("--speed-prompts", type=int, default=20)
    parser.add_argument("--heldout", type=Path, default=None, help="training/corpus.py's heldout.jsonl")
    parser.add_argument("--perplexity-tokens", type=int, default=1_000_000)
    parser.add_argument("--out-dir", type=Path, default=None)
    args = parser.parse_args()

    engine = Engine.from_pretrained(args.target, args.drafter, device=args.device, max_budget=max(args.budgets),
                                    kept_costs="off")
    prompts = [json.loads(line)["prompt"] for line in args.prompts.read_text().splitlines()]
    payload = {"environment": environment(), "device": str(engine.device), "dtype": str(engine.target.embed_tokens.weight.dtype),
               "pair": {"target": str(args.target or "demo"), "drafter": str(args.drafter or "demo")},
               "max_new_tokens": args.max_new_tokens, "cuda_graphs": engine.graphs is not None}
    if args.heldout is not None:
        payload["perplexity"] = perplexity(engine, args.heldout, args.perplexity_tokens, 1024)
        print(f"held-out perplexity {payload['perplexity']['perplexity']:.3f} over {payload['perplexity']['tokens']:,} tokens")
    count = len(prompts) if args.acceptance_prompts is None else args.acceptance_prompts
    payload["acceptance"] = acceptance(engine, prompts[:count], args) if count else []
    payload["speed"] = speed(engine, prompts[: args.speed_prompts], args) if args.speed_prompts else []

    rows = [[r["temperature"], r["mode"], r["budget"] or "-", f"{r['mean_acceptance_length']:.2f}",
             f"{r['equal_to_ar']}/{r['prompts']}", r["median_first_divergence"] if r["median_first_divergence"] is not None else "-"]
            for r in payload["acceptance"]]
    table = ""
    if "perplexity" in payload:
        p = payload["perplexity"]
        table += f"Held-out perplexity of the target: {p['perplexity']:.3f} ({p['tokens']:,} tokens).\n\n"
    if rows:
        table += markdown_table(["temperature", "mode", "budget", "mean acceptance length", "equal to ar",
                                 "median first divergence"], rows) + "\n\n"
    if payload["speed"]:
        table += f"Speed rows: rounds {'replayed from CUDA graphs' if engine.graphs is not None else 'eager'}.\n\n"
        table += markdown_table(["mode (batch 1)", "budget", "tokens/s", "speedup vs ar", "acceptance length"],
                                [[r["mode"], r["budget"] or "-", f"{r['tokens_per_s']:.1f}", f"{r['speedup_vs_ar']:.2f}x",
                                  f"{r['mean_acceptance_length']:.2f}"] for r in payload["speed"]])
    md = write_results("demo_pair", payload, table, args.out_dir)
    if payload["acceptance"] and payload["speed"]:
        plot(payload, md.with_suffix(".png"))
    print(md.read_text())


if __name__ == "__main__":
    main()
