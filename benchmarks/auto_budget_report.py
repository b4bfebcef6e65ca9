"""auto_budget.py's bars, tables and plot, and the summary of several of its result files."""

from __future__ import annotations

import json
from pathlib import Path

from common import RESULTS_DIR, environment, markdown_table, write_results

AUTO, WRONG = "auto", "auto, wrong drafter"


def _by_batch(rows: list[dict]) -> dict[int, list[dict]]:
    out: dict[int, list[dict]] = {}
    for row in rows:
        out.setdefault(row["batch"], []).append(row)
    return out


def speed_key(schedule: str | None) -> str:
    """The speed the bars compare: decode tokens/s for groups, where every configuration admits its
    prompts alike; tokens/s with the prefills for a continuous schedule, where trees admit prompts
    one by one and `ar` B at a time, so the prefill time measured once (with `ar`) fits neither."""
    return "tokens_per_s" if schedule == "continuous" else "decode_tokens_per_s"


def batch_ratios(rows: list[dict], key: str = "decode_tokens_per_s") -> dict:
    """For one B: auto over the best fixed configuration and over ar, in `key` (speed_key); the
    wrong drafter's auto over ar; ar_spread: how far ar's slowest timed pass was from its fastest."""
    speed = {r["config"]: r[key] for r in rows}
    fixed = {c: s for c, s in speed.items() if c not in (AUTO, WRONG)}
    best = max(fixed, key=fixed.get)
    ar_passes = next(r for r in rows if r["config"] == "ar").get("pass_seconds") or [1.0]
    out = {"best_fixed": best, "auto_over_best": speed[AUTO] / fixed[best], "auto_over_ar": speed[AUTO] / speed["ar"],
           "ar_spread": max(ar_passes) / min(ar_passes) - 1}
    if WRONG in speed:
        out["wrong_auto_over_ar"] = speed[WRONG] / speed["ar"]
    return out


def bars(rows: list[dict], replay: bool, key: str = "decode_tokens_per_s") -> dict:
    per_batch = {b: batch_ratios(r, key) for b, r in _by_batch(rows).items()}
    over_ar = [min(v["auto_over_ar"], v.get("wrong_auto_over_ar", 1e9)) for v in per_batch.values()]
    name = "auto_over_best_min_replay" if replay else "auto_over_best_min_demo"
    return {name: min(v["auto_over_best"] for v in per_batch.values()), "auto_over_ar_min": min(over_ar),
            "per_batch": {str(b): v for b, v in per_batch.items()}}


def table(payload: dict) -> str:
    parts = [f"Pair: {payload['pair']}, {payload['new_tokens']} new tokens per request"
             + (f", prompts of {payload['prefix']} random tokens" if payload.get("prefix") else ", held-out prompts")
             + (". B requests kept running, each finished one replaced by the next prompt (continuous batching)"
                if payload.get("schedule") == "continuous" else ". Prompts run in groups of B, one generate call each")
             + ". Speeds are of the median timed pass (of "
             + f"{payload.get('timed_passes', 1)}, run in rotation over the configurations), after a warm-up pass of "
             + "the same prompts"
             + (f" at {payload['warmup_new']} new tokens" if payload.get("warmup_new") else "")
             + "; decode tokens/s leaves out the first token and the prefill's wall time"
             + ("; the bars and 'vs best fixed' compare tokens/s with the prefills, as admissions differ by configuration"
                if payload.get("schedule") == "continuous" else "") + ".", "## Bars"]
    key = speed_key(payload.get("schedule"))
    parts.append("\n".join(f"- {k}: {v:.3f}" for k, v in payload["bars"].items() if k != "per_batch"))
    for batch, rows in _by_batch(payload["rows"]).items():
        ratios = payload["bars"]["per_batch"][str(batch)]
        best = next(r for r in rows if r["config"] == ratios["best_fixed"])[key]
        parts.append(f"## B = {batch} ({rows[0]['requests']} requests)")
        parts.append(markdown_table(
            ["config", "decode tokens/s", "vs best fixed", "tokens/s", "acceptance", "mean tree size", "tree rounds",
             "equal to ar", "device ms per round", "eager rounds"],
            [[r["config"], f"{r['decode_tokens_per_s']:.1f}", f"{r[key] / best:.3f}",
              f"{r['tokens_per_s']:.1f}", f"{r['mean_acceptance_length']:.2f}", f"{r['mean_tree_size']:.1f}",
              f"{r['tree_rounds']}/{r['rounds']}", f"{r['equal_to_ar']}/{r['requests']}", f"{r['round_ms']:.3f}",
              "-" if r["eager_rounds"] is None else r["eager_rounds"]] for r in rows]))
        auto = next(r for r in rows if r["config"] == AUTO)
        parts.append(f"auto's tree sizes (size: rounds): {auto['size_histogram']}")
        if auto.get("cost_ratios"):
            parts.append(f"auto's learned step costs over the table (bucket:size: [ratio, steps]): {auto['cost_ratios']}")
        eager = {r["config"]: r["eager_plans"] for r in rows if r.get("eager_plans")}
        if eager:
            parts.append("Eager rounds in the timed passes (each a plan's first round; its second captures the graph): "
                         + "; ".join(f"{c}: {p}" for c, p in eager.items()))
        costs = rows[0].get("round_costs_ms", {})
        if costs:
            sizes = list(next(iter(costs.values())))
            parts.append("Measured round costs (ms per step; size 0: a plain decode step):\n\n" + markdown_table(
                ["bucket"] + sizes, [[b] + [f"{row[s]:.3f}" for s in sizes] for b, row in costs.items()]))
    return "\n\n".join(parts)


def plot(payload: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = _by_batch(payload["rows"])
    fig, axes = plt.subplots(1, len(groups), figsize=(5 * len(groups), 4), squeeze=False)
    for ax, (batch, rows) in zip(axes[0], groups.items()):
        labels = [r["config"] for r in rows]
        speed = [r[speed_key(payload.get("schedule"))] for r in rows]
        colors = ["tab:red" if c in (AUTO, WRONG) else "tab:gray" if c.startswith("ar") else "tab:blue" for c in labels]
        ax.bar(range(len(rows)), speed, color=colors)
        ax.set_xticks(range(len(rows)), labels, rotation=60, ha="right", fontsize=8)
        ax.set_title(f"B = {batch}")
        ax.set_ylabel("tokens/s" if payload.get("schedule") == "continuous" else "decode tokens/s")
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle(f"budget auto vs fixed choices: {payload['pair']} on {payload['environment']['gpu']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def combine(paths: list[Path], out_dir: Path | None) -> Path:
    """The issue's three bars over several result files (demo files give the demo bar, real-size
    files the replay bar, all of them auto over ar)."""
    files = [json.loads(Path(p).read_text()) for p in paths]
    demo = [f["bars"]["auto_over_best_min_demo"] for f in files if "auto_over_best_min_demo" in f["bars"]]
    replay = [f["bars"]["auto_over_best_min_replay"] for f in files if "auto_over_best_min_replay" in f["bars"]]
    summary = {"bars": {"auto_over_best_min_demo": min(demo) if demo else None,
                        "auto_over_best_min_replay": min(replay) if replay else None,
                        "auto_over_ar_min": min(f["bars"]["auto_over_ar_min"] for f in files)},
               "files": [{"path": str(p), "pair": f["pair"], "gpu": f["environment"]["gpu"], "date": f["environment"]["date"],
                          "commit": f["environment"]["commit"],
                          "bars": {k: v for k, v in f["bars"].items() if k != "per_batch"}} for p, f in zip(paths, files)]}
    # the GPU the files were measured on (it names the output); date, commit and command of this summary
    summary["environment"] = {**files[0]["environment"], **{k: v for k, v in environment().items()
                                                           if k in ("date", "commit", "command")}}
    text = "## Bars\n\n" + "\n".join(f"- {k}: {'-' if v is None else f'{v:.3f}'}" for k, v in summary["bars"].items())
    text += "\n\n" + markdown_table(["file", "pair", "commit", "bars"], [[Path(f["path"]).name, f["pair"], f["commit"], json.dumps(
        {k: round(v, 3) for k, v in f["bars"].items()})] for f in summary["files"]])
    return write_results("auto_budget", summary, text, out_dir or RESULTS_DIR)
