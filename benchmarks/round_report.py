"""engine_round.py's outputs: the bars, the markdown tables and the PNG."""

from __future__ import annotations

from pathlib import Path

from common import markdown_table
from round_floors import FORMULAS, LEGEND

STAGE_ORDER = ("draft", "topk", "build", "verify", "accept", "commit")


def measured(cell: dict) -> tuple[str, dict]:
    """(source, {stage: spread, "round": spread}): the graph replays when they gave stage times,
    else the eager runs (per-stage numbers and the round total from one source)."""
    graph = cell.get("graph")
    if graph and "verify" in graph:
        return "graph", graph
    return "eager", cell["eager"]


def find(cells: list[dict], batch: int, budget: int) -> dict | None:
    return next((c for c in cells if c["B"] == batch and c["budget"] == budget), None)


AROUND_VERIFY = ("draft", "topk", "build", "accept", "commit")


def bars(cells: list[dict]) -> dict:
    """The issues' ratios (None where their cell was not run): issue 20's three, and issue 22's
    stages around the verify (ms at budget 16) and each stage's worst measured / floor."""
    out = {"ar_step_b1_over_floor": None, "build_accept_commit_share_b8_budget64": None, "draft_share_b1_budget64": None,
           "around_verify_ms_b1_budget16": None, "around_verify_ms_b32_budget16": None}
    ar = find(cells, 1, 0)
    if ar:
        total = (ar.get("graph") or ar["eager"])["round"]["median"]
        out["ar_step_b1_over_floor"] = total / ar["floors"]["weight_read"]["floor_us"]
    tree = find(cells, 8, 64)
    if tree:
        _, m = measured(tree)
        out["build_accept_commit_share_b8_budget64"] = sum(m[s]["median"] for s in ("build", "accept", "commit")) / m["round"]["median"]
    tree = find(cells, 1, 64)
    if tree:
        _, m = measured(tree)
        out["draft_share_b1_budget64"] = m["draft"]["median"] / m["round"]["median"]
    for batch in (1, 32):
        tree = find(cells, batch, 16)
        if tree:
            _, m = measured(tree)
            out[f"around_verify_ms_b{batch}_budget16"] = sum(m[s]["median"] for s in AROUND_VERIFY if s in m) / 1e3
    for stage in ("draft", "topk", "commit"):  # trees' stages: ar's commit (a length and a token) has no floor to speak of
        ratios = [c["measured_over_floor"][stage] for c in cells
                  if c["budget"] and stage in c.get("measured_over_floor", {})]
        out[f"{stage}_over_floor_max"] = max(ratios) if ratios else None
    return out


def _ms(spread: dict | None) -> str:
    if not spread:
        return "-"
    return f"{spread['median'] / 1e3:.3f} ({spread['p10'] / 1e3:.3f}-{spread['p90'] / 1e3:.3f})"


def stage_table(cells: list[dict]) -> str:
    rows = []
    for c in cells:
        graph = c.get("graph") or {}
        for stage in [s for s in STAGE_ORDER if s in c["eager"]] + ["round"]:
            floor = c["floors"][stage]
            best = graph.get(stage) or c["eager"][stage]
            rows.append([c["B"], c["budget"] or "ar", stage, _ms(c["eager"][stage]), _ms(graph.get(stage)),
                         f"{floor['floor_us'] / 1e3:.4f}", floor.get("bound", "-"),
                         f"{best['median'] / floor['floor_us']:.1f}"])
    return markdown_table(["B", "budget", "stage", "eager ms: median (p10-p90)", "graph ms: median (p10-p90)",
                           "floor ms", "bound", "measured / floor"], rows)


def experts_table(cells: list[dict]) -> str:
    rows = [[c["B"], c["budget"] or "ar", c["B"] * (c["budget"] + 1), f"{c['experts']['union_per_moe_layer_mean']:.1f}",
             f"{c['experts']['uniform_expectation_per_layer']:.1f}", f"{c['experts']['per_request_mean']:.1f}"]
            for c in cells if c["experts"]["union_per_moe_layer"]]
    return markdown_table(["B", "budget", "verify rows", "distinct experts per MoE layer (batch)",
                           "uniform routing would touch", "per request (engine's count)"], rows)


def e2e_table(rows: list[dict]) -> str:
    return markdown_table(
        ["B", "mode", "L", "tokens/s", "decode tokens/s", "speedup vs ar", "mean acceptance", "rounds at L",
         "equal to ar"],
        [[r["batch"], r["mode"], r["L"], f"{r['tokens_per_s']:.1f}", f"{r['decode_tokens_per_s']:.1f}",
          f"{r['speedup_vs_ar']:.2f}", f"{r['mean_acceptance_length']:.2f}", f"{r.get('rounds_at_L', 1.0):.2f}",
          f"{r['equal_to_ar']}/{r['batch']}"] for r in rows])


def scaled_table(cells: list[dict]) -> str:
    rows = [[c["B"], c["budget"] or "ar", f"{measured(c)[1]['round']['median'] / 1e3:.3f}",
             f"{c['scaled']['measured_round_us'] / 1e3:.3f}", f"{c['scaled']['floor_round_us'] / 1e3:.3f}"]
            for c in cells if c.get("scaled")]
    return markdown_table(["B", "budget", "round ms, measured here", "round ms, scaled", "floor ms, scaled"], rows)


def engine_kind(e2e: list[dict]) -> str:
    return "engine with CUDA graphs" if e2e and e2e[0].get("cuda_graphs") else "eager engine"


def markdown(payload: dict) -> str:
    s, cells = payload["setup"], payload["cells"]
    ceil = payload["ceilings"]
    parts = [
        f"{payload['config']}, first {s['target_layers']} of {s['published_layers']} layers, "
        f"{s['target_parameters'] / 1e9:.2f} B parameters, random {s['dtype']} weights built on {s['device']} "
        f"(successor target: round_setup.py), random DFlash drafter {s['drafter']}; prefix {s['prefix']} tokens per "
        f"request (random cache and drafter-context entries), page {s['page_size']}, greedy, kernel paths {s.get('kernels', 'auto')}. Measured ceilings: copy "
        f"{ceil['copy_bandwidth_GBps']:.4g} GB/s, bf16 matmul {ceil['bf16_matmul_TFLOPs']:.4g} TFLOP/s. Repeats: "
        f"eager {s['repeats']}, graph {s['graph_repeats']} (after {s['warmup']} warm-up rounds). "
        "Eager stage times (the engine's StageTimer: CUDA events between stages) include the device's idle time "
        "waiting for host launches; graph times (replays of one captured round, stage times from in-graph events) do "
        "not. Measured / floor uses the graph time where there is one." + (
            f" Graph capture failed here: {cells[0]['graph_error']}" if cells and cells[0].get("graph_error") else ""),
        "## Bars\n\n" + "\n".join(f"- {k}: {'-' if v is None else f'{v:.3f}'}" for k, v in payload["bars"].items()),
        "## One round, per stage\n\n" + stage_table(cells),
        "## Routed experts the verify touched\n\n" + experts_table(cells),
    ]
    if payload.get("scaled_note"):
        parts.append(f"## Scaled to {s['published_layers']} layers\n\n{payload['scaled_note']}\n\n" + scaled_table(cells))
    if payload.get("e2e"):
        parts.append(f"## End to end, acceptance forced to L ({engine_kind(payload['e2e'])})\n\n" + payload["e2e_note"] + "\n\n"
                     + e2e_table(payload["e2e"]))
    parts.append("## Floor formulas\n\n" + "\n".join(f"- {k}: {v}" for k, v in FORMULAS.items()) + f"\n\n{LEGEND}")
    return "\n\n".join(parts)


def plot(payload: dict, path: Path) -> bool:
    """Stacked stage times vs floors per (B, budget), and e2e tokens/s against L; False without matplotlib."""
    try:
        import matplotlib
    except ImportError:
        print("matplotlib not installed: no PNG", flush=True)
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    cells, e2e = payload["cells"], payload.get("e2e") or []
    batches = sorted({c["B"] for c in cells})
    fig, axes = plt.subplots(2 if e2e else 1, len(batches), figsize=(4.5 * len(batches), 8 if e2e else 4), squeeze=False)
    colors = dict(zip(STAGE_ORDER, ("tab:blue", "tab:cyan", "tab:olive", "tab:red", "tab:orange", "tab:purple")))
    for ax, batch in zip(axes[0], batches):
        row = [c for c in cells if c["B"] == batch]
        for i, c in enumerate(row):
            source, m = measured(c)
            if source == "graph":
                ax.plot(i - 0.2, c["eager"]["round"]["median"] / 1e3, "k_", markersize=18)
            stages = [s for s in STAGE_ORDER if s in m]
            for x, values in ((i - 0.2, [m[s]["median"] for s in stages]), (i + 0.2, [c["floors"][s]["floor_us"] for s in stages])):
                bottom = 0.0
                for stage, us in zip(stages, values):
                    ax.bar(x, us / 1e3, 0.38, bottom=bottom, color=colors[stage], hatch="//" if x > i else None,
                           edgecolor="white")
                    bottom += us / 1e3
        ax.set_xticks(range(len(row)), [f"{'ar' if c['budget'] == 0 else c['budget']}\n{measured(c)[0]} | floor"
                                        for c in row], fontsize=8)
        ax.set_title(f"B = {batch}: one round (solid; eager: black tick) vs floor (hatched)", fontsize=9)
        ax.set_ylabel("ms")
        ax.grid(alpha=0.3, axis="y")
    axes[0][0].legend(handles=[Patch(color=colors[s], label=s) for s in STAGE_ORDER], fontsize=7)
    e2e_batches = sorted({r["batch"] for r in e2e})
    for j, ax in enumerate(axes[1] if e2e else []):
        if j >= len(e2e_batches):
            ax.set_visible(False)
            continue
        rows = [r for r in e2e if r["batch"] == e2e_batches[j]]
        for mode, color in (("chain", "tab:blue"), ("ddtree", "tab:green")):
            pts = [r for r in rows if r["mode"] == mode]
            ax.plot([r["L"] for r in pts], [r["tokens_per_s"] for r in pts], "o-", color=color, label=mode)
        for r in rows:
            if r["mode"] == "ar":
                ax.axhline(r["tokens_per_s"], color="gray", linestyle="--", label="ar")
        ax.set_xlabel("forced acceptance length L")
        ax.set_ylabel(f"tokens/s ({engine_kind(e2e)})")
        ax.set_title(f"B = {e2e_batches[j]}: end to end", fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"{payload['config']} ({payload['setup']['target_layers']} layers) on {payload['environment']['gpu']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
