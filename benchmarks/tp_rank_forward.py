"""One tensor-parallel rank's share of the target's forward, measured alone on one GPU.

    python benchmarks/tp_rank_forward.py --config kimi-k2.6 --ranks 8            # all 61 layers (~71 GiB)
    python benchmarks/tp_rank_forward.py --config kimi-k2.6 --ranks 8 --layers 6 # 2 and 6 layers, scaled

The target is built with random weights as rank `--rank` of `--ranks` builds it (parallel/shard.py:
its heads, its 1/N of the routed experts, its columns of the shared experts and dense MLP, its
vocabulary rows), on one GPU, with the collectives left out: each all-reduce returns its input and
the logits' all-gather repeats this rank's part (the same bytes written). So the time is the rank's
own work in a decode step (rows 1) or a tree verify (rows = budget + 1), over a committed prefix,
replayed from a CUDA graph (median of many replays). Random routing spreads rows over all experts,
so the rank computes its experts' share as it would with its peers. What the collectives add is
for tp_projection.py (--measured reads this file's JSON).

With --layers below the published depth, a 2-layer model is timed too and the published depth is
reached linearly: T(full) = T(2) + (full - 2) (T(L) - T(2)) / (L - 2), labelled as scaled.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import environment, markdown_table, time_graph_us, write_results  # noqa: E402
from round_setup import target_config  # noqa: E402
from target_forward import setup  # noqa: E402

from ddtree.models import TargetConfig, random_target  # noqa: E402
from ddtree.parallel.shard import Shard  # noqa: E402


@dataclass(frozen=True)
class LoneRank(Shard):
    """A rank's share of a world-way split, run alone: no process group, no collectives."""

    def __post_init__(self):
        if not 0 <= self.rank < self.world:
            raise ValueError(f"rank {self.rank} is not in a world of {self.world}")

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        return t

    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        return torch.cat([t] * self.world, dim=-1)

    def agree(self, value: int) -> int:
        return value


@torch.no_grad()
def time_depth(cfg: TargetConfig, shard: Shard, shapes: list[tuple[int, int]], prefix: int, device: str) -> dict:
    """{(B, rows): microseconds of one forward} for a `cfg.num_hidden_layers`-layer rank share."""
    model = random_target(cfg, dtype=torch.bfloat16, device=device, shard=shard)
    times = {}
    for batch, rows in shapes:
        ids, meta, caches = setup(model, batch, rows, prefix)
        times[batch, rows] = time_graph_us(lambda: model.forward_paged(ids, meta, caches), launches_per_graph=2,
                                           trials=10)
        print(f"  {cfg.num_hidden_layers} layers, B {batch}, rows {rows}: {times[batch, rows]:.0f} us", flush=True)
        ids = meta = caches = None
        torch.cuda.empty_cache()
    model = None
    torch.cuda.empty_cache()
    return times


def main(argv=None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="kimi-k2.6")
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--layers", type=int, default=None, help="keep the first L decoder layers (>= 3; default all)")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--budgets", type=int, nargs="+", default=[0, 4, 8, 16], help="rows = budget + 1 (0: decode)")
    parser.add_argument("--prefix", type=int, default=1024)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("tp_rank_forward.py needs a CUDA GPU")
    full = target_config(args.config, None)[1]
    layers = min(args.layers or full, full)
    if layers < 3:
        sys.exit("--layers must be at least 3 (the scaling subtracts a 2-layer model)")
    shard = LoneRank(args.rank, args.ranks)
    shapes = [(b, budget + 1) for b in args.batches for budget in args.budgets]
    print(f"{args.config}: rank {args.rank} of {args.ranks}, {layers} of {full} layers", flush=True)
    deep = time_depth(target_config(args.config, layers)[0], shard, shapes, args.prefix, "cuda")
    shallow = time_depth(target_config(args.config, 2)[0], shard, shapes, args.prefix, "cuda") if layers < full else None
    rows = []
    for batch, n in shapes:
        t = deep[batch, n]
        if shallow:
            t = shallow[batch, n] + (full - 2) * (deep[batch, n] - shallow[batch, n]) / (layers - 2)
        rows.append({"batch": batch, "rows": n, "measured_layers": layers, "measured_us": deep[batch, n],
                     "two_layer_us": shallow[batch, n] if shallow else None, "forward_us": t, "scaled": bool(shallow)})
    for row in rows:
        ar = next(r for r in rows if r["batch"] == row["batch"] and r["rows"] == 1)
        row["over_ar"] = row["forward_us"] / ar["forward_us"]
    how = "measured" if layers == full else f"scaled from {layers} and 2 layers"
    table = markdown_table(
        ["B", "rows", f"{layers} layers measured (ms)", f"{full} layers, {how} (ms)", "x decode step"],
        [[r["batch"], r["rows"], f"{r['measured_us'] / 1e3:.3f}", f"{r['forward_us'] / 1e3:.3f}",
          f"{r['over_ar']:.2f}"] for r in rows])
    note = (f"{args.config}: rank {args.rank} of {args.ranks} alone on one GPU (its heads, experts, columns and "
            f"vocabulary rows; random bf16 weights, INT4 experts where the config has them), collectives left out. "
            f"Target forward over a committed prefix of {args.prefix}, CUDA graph replays, median.")
    payload = {"environment": environment(), "config": args.config, "ranks": args.ranks, "rank": args.rank,
               "layers": layers, "published_layers": full, "prefix": args.prefix, "rows": rows}
    path = write_results(f"tp_rank_forward-{args.config}-rank{args.rank}of{args.ranks}", payload,
                         note + "\n\n" + table, args.out)
    print(path.read_text())
    return path


if __name__ == "__main__":
    main()
