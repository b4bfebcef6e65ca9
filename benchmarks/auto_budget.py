"""budget="auto" beside every fixed choice, in one run: tokens/s of `auto`, `ar`, `chain` and
ddtree at fixed budgets, per batch size B, on the same prompts.

    python benchmarks/auto_budget.py --pair demo                         # the demo pair (held-out prompts)
    python benchmarks/auto_budget.py --pair demo --device cpu --batches 1 8
    python benchmarks/auto_budget.py --pair moonlight-16b-a3b --wrong    # random weights, replayed acceptance
    python benchmarks/auto_budget.py --pair kimi-k2 --layers 4 --wrong
    python benchmarks/auto_budget.py --combine results/auto_budget-*-nvidia-h200.json

Real-size pairs (benchmarks/configs/) are round_setup's successor targets with a random DFlash
drafter wrapped in replay_drafter.ReplayDrafter: the demo pair's recorded rounds replayed on the
target's greedy continuation. --wrong adds `auto` with a drafter that is always wrong.

Each B has an engine of its own (max_batch = B) whose round costs are measured at start-up
(the buckets an earlier B's engine measured are taken from it, as a kept table would be). The
prompts run in groups of B, one generate call per group (--schedule groups, the default), so
that every configuration admits and prefills them the same way; a group lasts as long as its
slowest request (a tree's requests finish at different rounds, `ar`'s of equal length together).
--schedule continuous gives all of a B's prompts to one generate call instead: a request that
finishes hands its slot to the next prompt at once (as vLLM's max_num_seqs), each admission a
prefill of its own. Every configuration runs a warm-up pass of the same prompts
(--warmup-new tokens, by default as many as the timed pass: kernels compiled, graphs captured for
the contexts the timed pass reaches, auto's sizer taught, as in a server that has been up a
while); then the --passes timed passes run in rotation (one of each configuration, then the next),
so that the machine's drift during the run falls on every configuration alike, and each reports
its median pass. Each auto configuration keeps what its sizer learned to itself. tokens/s:
generated tokens over the wall time of the pass; decode tokens/s leaves out the first token and
the wall time of the same prompts at max_new_tokens = 1 (their prefill). The bars use decode
tokens/s, or under --schedule continuous tokens/s with the prefills (auto_budget_report.speed_key).
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from collections import Counter
from contextlib import nullcontext
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from auto_budget_report import bars, combine, plot, speed_key, table  # noqa: E402
from common import environment, write_results  # noqa: E402

from ddtree import Engine  # noqa: E402
from ddtree.engine.pages import pages_for  # noqa: E402

PROMPTS = Path(__file__).resolve().parent / "data" / "demo_prompts.jsonl"
PROMPTS_PER_BATCH = {1: 16, 8: 32, 32: 64}  # demo pair: B = 1 runs 16 prompts one after another
CONTINUOUS_PROMPTS = {8: 64, 32: 120}  # --schedule continuous: more prompts than slots (120 held out)


def configs(budgets: list[int], wrong: bool) -> list[tuple[str, str, object]]:
    """(label, mode, budget) in run order."""
    rows = [("ar", "ar", 1), ("chain", "chain", 1)] + [(f"ddtree {b}", "ddtree", b) for b in budgets]
    rows.append(("auto", "ddtree", "auto"))
    if wrong:
        rows.append(("auto, wrong drafter", "ddtree", "auto"))
    return rows


class Workload:
    """The prompts of one B and how a pass runs them: all in one generate call (continuous), or
    in groups of B (one generate call each)."""

    def __init__(self, engine: Engine, prompts: list, new: int, batch: int, schedule: str = "groups",
                 replay=None, prefix: int | None = None):
        """replay: the ReplayDrafter to give each admitted prompt its truth; prefix: the prompts'
        length (round costs are measured at it)."""
        if schedule not in ("continuous", "groups"):
            raise ValueError(f"schedule must be 'continuous' or 'groups', got {schedule!r}")
        self.engine, self.prompts, self.new, self.replay, self.prefix = engine, prompts, new, replay, prefix
        self.groups = [prompts] if schedule == "continuous" else [prompts[i : i + batch] for i in range(0, len(prompts), batch)]
        self.truth: dict[tuple, list[int]] = {}  # prompt -> prompt + ar's tokens (the replay's truth)
        self.warmup_new = new
        self.passes = 1  # timed passes per configuration (the median one is reported)
        if replay is not None:
            self._tell_replay_at_prefill()

    def set_continuations(self, outs: list) -> None:
        self.truth = {tuple(p): list(p) + o.token_ids for p, o in zip(self.prompts, outs)}

    def _tell_replay_at_prefill(self) -> None:
        """A request's slot is known only once the engine admits it: the replay drafter learns the
        slot's truth (prompt + continuation, or only the prompt before `ar` has run) as the prompt
        is prefilled, before any round drafts for it."""
        worker, replay = self.engine.worker, self.replay
        prefill = worker.prefill

        def prefill_with_truth(table, slots, prompts, *args):
            for slot, prompt in zip(slots, prompts):
                replay.set_sequence(slot, self.truth.get(tuple(prompt), list(prompt)))
            return prefill(table, slots, prompts, *args)

        worker.prefill = prefill_with_truth

    def run(self, mode: str, budget, new: int | None = None) -> tuple[float, list]:
        """One pass over every prompt; (wall seconds, outputs in prompt order)."""
        engine, outs, seconds = self.engine, [], 0.0
        for group in self.groups:
            if engine.device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            outs += engine.generate(group, max_new_tokens=new or self.new, mode=mode, budget=budget, temperature=0.0)
            seconds += time.perf_counter() - start
        return seconds, outs


class AutoState:
    """What the sizer learns, kept apart per auto configuration (entered around each of its passes):
    the interleaved passes of auto and of auto with the always-wrong drafter must not teach each
    other. wrong: the replay drafter is wrong during the passes."""

    def __init__(self, engine: Engine, replay, wrong: bool):
        self.sizer, self.replay, self.wrong = engine.sizer, replay, wrong
        self.saved = engine.sizer.fresh_state()

    def __enter__(self):
        self.outside, self.sizer.state = self.sizer.state, self.saved
        if self.replay is not None:
            self.replay.wrong = self.wrong

    def __exit__(self, *exc):
        self.saved, self.sizer.state = self.sizer.state, self.outside
        if self.replay is not None:
            self.replay.wrong = False

    @property
    def ratios(self) -> dict:
        return self.saved.correction.ratios


def summarize(work: Workload, label: str, mode: str, budget, passes: list, eager: int | None, ar_tokens: list,
              prefill_s: float, ratios: dict | None) -> dict:
    """One configuration's row from its timed passes [(seconds, outputs)], the median one reported."""
    seconds, outs = sorted(passes, key=lambda p: p[0])[len(passes) // 2]  # the slower middle one of an even count
    tokens = sum(len(o.token_ids) for o in outs)
    rounds = [n for o in outs for n in o.stats.acceptance_lengths]
    sizes = [s for o in outs for s in o.stats.tree_sizes]
    row = {"config": label, "mode": mode, "budget": budget, "requests": len(outs), "tokens": tokens,
           "seconds": seconds, "pass_seconds": [p[0] for p in passes], "tokens_per_s": tokens / seconds,
           "decode_tokens_per_s": (tokens - len(outs)) / max(seconds - prefill_s, 1e-9),
           "mean_acceptance_length": sum(rounds) / max(1, len(rounds)), "rounds": len(rounds),
           "tree_rounds": sum(s > 0 for s in sizes), "mean_tree_size": sum(sizes) / max(1, len(sizes)),
           "size_histogram": {str(s): sizes.count(s) for s in sorted(set(sizes))},
           "equal_to_ar": sum(o.token_ids == a for o, a in zip(outs, ar_tokens)),
           # the device's time per round (CUDA events around each round; each request counts its rounds)
           "round_ms": 1e3 * sum(sum(v for k, v in o.stats.stage_seconds.items() if k != "prefill") for o in outs)
           / max(1, len(rounds)),
           "eager_rounds": eager}
    if ratios is not None:  # what the sizer learned real steps cost over the table: (bucket, size) -> ratio
        row["cost_ratios"] = {f"{b}:{'trees' if s < 0 else s}": [round(r, 3), n] for (b, s), (r, n) in sorted(ratios.items())}
    print(f"  {label:22s} {row['decode_tokens_per_s']:9.1f} decode tokens/s ({row['tokens_per_s']:.1f} with prefill), "
          f"acceptance {row['mean_acceptance_length']:.2f}, mean size {row['mean_tree_size']:.1f}, "
          f"equal to ar {row['equal_to_ar']}", flush=True)
    return row


def run_batch(engine: Engine, work: Workload, batch: int, budgets: list[int], wrong: bool) -> list[dict]:
    """Every configuration's warm-up pass, then the timed passes in rotation (pass 1 of each, then
    pass 2 of each, ...), so that a drift of the machine's speed during the run falls on all alike."""
    start = time.perf_counter()
    costs = engine.measure_round_costs(prefix=work.prefix)
    print(f"B={batch}: round costs measured in {time.perf_counter() - start:.1f} s", flush=True)
    work.run("ar", 1, new=1)
    prefill_s = sorted(work.run("ar", 1, new=1)[0] for _ in range(3))[1]
    _, ar_outs = work.run("ar", 1)
    ar_tokens = [o.token_ids for o in ar_outs]
    work.set_continuations(ar_outs)
    plan = configs(budgets, wrong)
    states = {label: AutoState(engine, work.replay, label.endswith("wrong drafter"))
              for label, _, budget in plan if budget == "auto"}
    graphs = engine.graphs
    eager = dict.fromkeys((label for label, _, _ in plan), 0)
    eager_plans = {label: Counter() for label, _, _ in plan}  # describe(plan) of each timed eager round
    passes: dict[str, list] = {label: [] for label, _, _ in plan}

    def one_pass(label: str, mode: str, budget, timed: bool) -> None:
        with states.get(label) or nullcontext():
            before = graphs.eager_rounds if graphs is not None else 0
            plans_before = Counter(graphs.eager_plans) if graphs is not None else Counter()
            result = work.run(mode, budget, new=None if timed else work.warmup_new)
        if timed:
            passes[label].append(result)
            eager[label] += (graphs.eager_rounds if graphs is not None else 0) - before
            if graphs is not None:
                eager_plans[label] += graphs.eager_plans - plans_before

    for label, mode, budget in plan:
        one_pass(label, mode, budget, timed=False)
    for _ in range(work.passes):
        for label, mode, budget in plan:
            one_pass(label, mode, budget, timed=True)
    rows = [summarize(work, label, mode, budget, passes[label], None if graphs is None else eager[label], ar_tokens,
                      prefill_s, states[label].ratios if label in states else None)
            for label, mode, budget in plan]
    for row in rows:
        row.update(batch=batch, prefill_seconds=prefill_s)
        if eager_plans[row["config"]]:
            row["eager_plans"] = dict(eager_plans[row["config"]])
    rows[0]["round_costs_ms"] = {str(b): {str(s): t * 1e3 for s, t in r.items()} for b, r in costs.seconds.items()}
    return rows


def demo_workloads(args, device):
    prompts = [json.loads(line)["prompt"] for line in PROMPTS.read_text().splitlines()]
    for batch in args.batches:
        engine = Engine.from_pretrained(device=device, max_batch=batch, max_budget=max(args.budgets),
                                        round_costs=args.round_costs, kept_costs="off")  # measured in this run
        per_batch = CONTINUOUS_PROMPTS if args.schedule == "continuous" else PROMPTS_PER_BATCH
        chosen = prompts[: per_batch.get(batch, PROMPTS_PER_BATCH.get(batch, 4 * batch))]
        yield batch, engine, Workload(engine, chosen, args.new, batch, args.schedule)


def replay_workloads(args, device):
    from replay_drafter import ReplayDrafter
    from round_setup import build_pair

    target, drafter, _, info = build_pair(args.pair, args.layers, device)
    args.pair_info = info
    gen = torch.Generator().manual_seed(5)
    vocab = target.cfg.vocab_size
    max_len = args.prefix + max(args.new, 256) + 64  # round-cost stand-ins run ~210 tokens past the prefix
    for batch in args.batches:
        count = 4 * batch if args.schedule == "continuous" else batch * max(1, 4 // batch)
        prompts = [torch.randint(0, vocab - 1, (args.prefix,), generator=gen).tolist() for _ in range(count)]
        replay = ReplayDrafter(drafter, batch, max_len + 64)
        pages = batch * pages_for(max_len + max(args.budgets) + 1, 64) + 1
        engine = Engine(target, replay, max_batch=batch, max_model_len=max_len, max_budget=max(args.budgets),
                        num_pages=pages, stop_token_ids=(), round_costs=args.round_costs, kept_costs="off")
        yield batch, engine, Workload(engine, prompts, args.new, batch, args.schedule, replay, args.prefix)
        del engine, replay
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pair", default="demo", help="demo, or a config of benchmarks/configs (tiny: CPU smoke)")
    parser.add_argument("--layers", type=int, default=None, help="real-size pairs: the first N decoder layers")
    parser.add_argument("--device", default=None)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--budgets", type=int, nargs="+", default=[4, 8, 16, 32, 64])
    parser.add_argument("--new", type=int, default=128, help="new tokens per request")
    parser.add_argument("--prefix", type=int, default=512, help="real-size pairs: prompt tokens")
    parser.add_argument("--warmup-new", type=int, default=None, help="new tokens of each warm-up pass (default --new)")
    parser.add_argument("--passes", type=int, default=1, help="timed passes per configuration (the median is reported)")
    parser.add_argument("--schedule", choices=("groups", "continuous"), default="groups",
                        help="groups: one generate per B prompts; continuous: B requests kept running over all prompts")
    parser.add_argument("--wrong", action="store_true", help="real-size pairs: also auto with an always-wrong drafter")
    parser.add_argument("--out-dir", type=Path, default=None)
    parser.add_argument("--combine", type=Path, nargs="+", default=None, help="write the bars of these result files")
    args = parser.parse_args()
    if args.combine:
        print(combine(args.combine, args.out_dir).read_text())
        return
    env = environment()  # at the start: the commit of the code that runs
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cpu":  # denormal floats slow some CPU steps of the random models twofold, at random
        torch.set_flush_denormal(True)
    workloads = demo_workloads(args, device) if args.pair == "demo" else replay_workloads(args, device)
    rows = []
    args.round_costs = None  # each B's engine measures only the buckets the ones before it did not
    for batch, engine, work in workloads:
        work.warmup_new, work.passes = args.warmup_new or args.new, args.passes
        rows += run_batch(engine, work, batch, args.budgets, args.wrong)
        args.round_costs = engine.sizer.costs
    name = args.pair + (f"-{args.layers}l" if args.layers else "")
    payload = {"environment": env, "pair": name, "device": str(device), "new_tokens": args.new,
               "batches": args.batches, "budgets": args.budgets, "rows": rows, "warmup_new": args.warmup_new or args.new,
               "timed_passes": args.passes, "schedule": args.schedule,
               "pair_info": getattr(args, "pair_info", None), "prefix": None if args.pair == "demo" else args.prefix}
    payload["bars"] = bars(rows, replay=args.pair != "demo", key=speed_key(args.schedule))
    md = write_results(f"auto_budget-{name}", payload, table(payload), args.out_dir)
    try:
        plot(payload, md.with_suffix(".png"))
    except ImportError:  # the bench extra brings matplotlib; the tables are written either way
        print("matplotlib is not installed: no plot (pip install -e '.[bench]')")
    print(md.read_text())


if __name__ == "__main__":
    main()
