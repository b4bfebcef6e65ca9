"""A projection, not a measurement: one Kimi K2.6 (INT4 experts) decode step and tree round split over
N GPUs as parallel/shard.py splits it, from the bytes each rank must read and the collectives each
forward makes, at an assumed copy bandwidth and an assumed all-reduce cost.

    python benchmarks/tp_projection.py --ranks 8 --bandwidth-GBps 4300 --collective-us 15 --bus-GBps 350

Per rank: the weights it reads (its heads, its columns, its vocabulary rows, the replicated
projections and routers, and its share of the touched experts: the most loaded rank's, under
uniform routing, by simulation), the latent cache of the batch's prefix, and per forward 2 all-reduces
a layer, one for the embedding and one all-gather of the logits (a drafter pass adds one of each),
each costing collective_us + bytes / bus bandwidth. Nothing here ran on a GPU: the figures are the
assumptions' consequences, written to benchmarks/results/ labelled as a projection.

    python benchmarks/tp_projection.py --measured benchmarks/results/tp_rank_forward-kimi-k2.6-rank0of8-nvidia-h200.json

--measured takes a rank's own work from tp_rank_forward.py (one rank's share of the forward timed
alone on one GPU) in place of the bytes at the assumed bandwidth; the collectives stay assumed.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import environment, markdown_table, write_results  # noqa: E402

from ddtree.models import TargetConfig  # noqa: E402

CONFIGS = Path(__file__).resolve().parent / "configs"


def most_loaded_rank(cfg, ranks: int, rows: int, trials: int = 200, seed: int = 0) -> float:
    """Mean over trials of the most distinct experts any rank's share holds, per MoE layer, when
    `rows` rows each choose k distinct experts uniformly."""
    rng = random.Random(seed)
    per_rank, total = cfg.n_routed_experts // ranks, 0
    for _ in range(trials):
        touched = set()
        for _ in range(rows):
            touched.update(rng.sample(range(cfg.n_routed_experts), cfg.num_experts_per_tok))
        counts = [0] * ranks
        for e in touched:
            counts[e // per_rank] += 1
        total += max(counts)
    return total / trials


def rank_bytes(cfg, ranks: int, rows: int, prefix: int, batch: int) -> dict:
    """Bytes one rank reads in a forward of `rows` rows per request (the most loaded rank's experts)."""
    h, heads, e = cfg.hidden_size, cfg.num_attention_heads, 2
    qk, v = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, cfg.v_head_dim
    latent = cfg.kv_lora_rank + cfg.qk_rope_head_dim
    replicated = h * (cfg.q_lora_rank or 0) + h * latent  # q_a and kv_a: every rank computes the latent
    split = (cfg.q_lora_rank or h) * heads * qk + cfg.kv_lora_rank * heads * (cfg.qk_nope_head_dim + v) + heads * v * h
    moe_layers = sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))
    dense_layers = cfg.num_hidden_layers - moe_layers
    shared = 3 * h * cfg.moe_intermediate_size * cfg.n_shared_experts
    router = cfg.n_routed_experts * h
    g = cfg.int4_experts.group_size
    expert = 3 * h * cfg.moe_intermediate_size * (0.5 + 2 / g)  # packed words and a bf16 scale per group
    touched = most_loaded_rank(cfg, ranks, batch * rows)
    return {
        "attention": cfg.num_hidden_layers * e * (replicated + split / ranks),
        "dense_mlp": dense_layers * e * 3 * h * cfg.intermediate_size / ranks,
        "shared_experts_and_routers": moe_layers * e * (shared / ranks + router),
        "routed_experts": moe_layers * touched * expert,
        "lm_head": e * cfg.vocab_size * h / ranks,
        "latent_cache": cfg.num_hidden_layers * batch * (prefix + rows) * latent * e,
        "experts_on_busiest_rank_per_layer": touched,
    }


def load_measured(path: Path, config: str, prefix: int) -> tuple[int, dict, dict]:
    """(ranks, {(B, rows): a rank's forward in us}, the run's environment) from tp_rank_forward.py's JSON."""
    data = json.loads(Path(path).read_text())
    if data["config"] != config or data["prefix"] != prefix:
        raise SystemExit(f"{path} measured {data['config']} at prefix {data['prefix']}, not {config} at {prefix}")
    return data["ranks"], {(r["batch"], r["rows"]): r["forward_us"] for r in data["rows"]}, data["environment"]


def project(cfg, ranks: int, batch: int, rows: int, prefix: int, args, measured: dict | None = None) -> dict:
    parts = rank_bytes(cfg, ranks, rows, prefix, batch)
    touched = parts.pop("experts_on_busiest_rank_per_layer")
    read_us = sum(parts.values()) / (args.bandwidth_GBps * 1e3)
    if measured is not None:
        if (batch, rows) not in measured:
            raise SystemExit(f"the measured file has no B = {batch}, rows = {rows}")
        read_us = measured[batch, rows]
    tokens = batch * rows
    collectives = 2 * cfg.num_hidden_layers + 2 if ranks > 1 else 0  # per layer 2, the embedding, the logits
    reduce_bytes = tokens * cfg.hidden_size * 2
    gather_bytes = tokens * cfg.vocab_size * 4
    comm_us = 0.0
    if ranks > 1:
        ring = 2 * (ranks - 1) / ranks  # an all-reduce moves this many times the message per rank
        comm_us = collectives * args.collective_us + ((collectives - 1) * reduce_bytes * ring
                                                      + gather_bytes * (ranks - 1) / ranks) / (args.bus_GBps * 1e3)
    return {"ranks": ranks, "batch": batch, "rows": rows, "read_us": read_us, "collectives": collectives,
            "collectives_us": comm_us, "step_us": read_us + comm_us, "busiest_rank_experts_per_layer": touched,
            "bytes_per_rank": parts}


def main(argv=None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="kimi-k2.6")
    parser.add_argument("--ranks", type=int, nargs="+", default=[8])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--budgets", type=int, nargs="+", default=[0, 4, 8, 16])
    parser.add_argument("--prefix", type=int, default=1024)
    parser.add_argument("--bandwidth-GBps", type=float, default=4300.0, help="each GPU's copy bandwidth (assumed)")
    parser.add_argument("--collective-us", type=float, default=15.0, help="latency of one small collective (assumed)")
    parser.add_argument("--bus-GBps", type=float, default=350.0, help="all-reduce bus bandwidth (assumed)")
    parser.add_argument("--measured", type=Path, default=None,
                        help="tp_rank_forward.py's JSON: a rank's measured work in place of the bytes' estimate")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    raw = json.loads((CONFIGS / f"{args.config}.json").read_text())
    raw.pop("benchmark_drafter", None)
    cfg = TargetConfig.from_dict(raw)
    measured, run = None, None
    if args.measured:
        ranks, measured, run = load_measured(args.measured, args.config, args.prefix)
        args.ranks = [ranks]
    rows = [project(cfg, r, b, budget + 1, args.prefix, args, measured) for r in args.ranks for b in args.batches
            for budget in args.budgets]
    for row in rows:
        ar = next(x for x in rows if x["ranks"] == row["ranks"] and x["batch"] == row["batch"] and x["rows"] == 1)
        row["over_ar"] = row["step_us"] / ar["step_us"]
    table = markdown_table(
        ["ranks", "B", "tree rows", "a rank's work, measured (us)" if measured else "weights + cache read (us)", "collectives", "collectives (us)", "forward (us)",
         "x ar step", "experts on the busiest rank per layer"],
        [[r["ranks"], r["batch"], r["rows"], f"{r['read_us']:.0f}", r["collectives"], f"{r['collectives_us']:.0f}",
          f"{r['step_us']:.0f}", f"{r['over_ar']:.2f}", f"{r['busiest_rank_experts_per_layer']:.1f}"] for r in rows])
    work = (f"A rank's own work measured on one {run['gpu']} at {run['commit']} ({args.measured.name}); the "
            f"collectives assumed: " if measured else
            f"Assumed: {args.bandwidth_GBps:.0f} GB/s copy bandwidth per GPU, ")
    note = (f"A PROJECTION: no machine of {args.ranks[0]} GPUs ran this. Target forward only (the drafter pass, "
            f"top-k, build and commit are left out). {work}{args.collective_us:.0f} us per collective plus its "
            f"bytes at {args.bus_GBps:.0f} GB/s bus bandwidth; uniform routing; prefix {args.prefix}.")
    payload = {"environment": environment(), "projection": True, "config": args.config, "assumptions": vars(args) | {
        "out": None, "measured": str(args.measured) if args.measured else None}, "measured_run": run, "rows": rows}
    name = f"tp_projection-{args.config}" + ("-measured" if measured else "")
    path = write_results(name, payload, note + "\n\n" + table, args.out)
    print(path.read_text())
    return path


if __name__ == "__main__":
    main()
