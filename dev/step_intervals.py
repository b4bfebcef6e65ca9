"""The wall time between an engine's consecutive reads of rounds of one shape, by plan (size, drafter
rows set aside, appended), for the demo pair in groups of B (auto_budget's schedule): what the
sizer's step correction sees, `ar` beside auto. Also counts the synchronizing calls torch reports
(torch.cuda.set_sync_debug_mode) during the timed pass.

    python dev/step_intervals.py --batch 32 --configs ar ddtree,auto --warmup
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from collections import Counter, defaultdict
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "dev"))

from ddtree import Engine  # noqa: E402
from demo_step_profile import demo_prompts  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--configs", nargs="+", default=["ar", "ddtree,auto"])
    parser.add_argument("--warmup", action="store_true", help="report the warm-up pass too (where auto learns)")
    args = parser.parse_args()
    prompts = demo_prompts(args.prompts)
    engine = Engine.from_pretrained(max_batch=args.batch, max_budget=64, kept_costs="off")
    engine.measure_round_costs()
    reads = []
    original = engine._collect

    def collect(flight):
        flight.rows()  # wait here, so the time is the round's end as the engine's own read sees it
        p = flight.plan
        reads.append((time.perf_counter(), p.bucket, p.budget, p.features, p.flush, flight.irregular))
        return original(flight)

    engine._collect = collect
    cuda = engine.device.type == "cuda"
    for config in args.configs:
        mode, _, budget = config.partition(",")
        budget = "auto" if budget == "auto" else int(budget or 1)
        groups = [prompts[i : i + args.batch] for i in range(0, len(prompts), args.batch)]
        warmup = timed_pass(engine, groups, mode, budget, reads)  # auto's sizer learns its corrections here
        if args.warmup:
            report(f"{config} at B = {args.batch}, warm-up pass", engine, reads, *warmup, Counter())
        syncs = Counter()
        if cuda:
            torch.cuda.set_sync_debug_mode("warn")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            timed = timed_pass(engine, groups, mode, budget, reads)
        if cuda:
            torch.cuda.set_sync_debug_mode(0)
        for w in caught:
            syncs[f"{Path(w.filename).name}:{w.lineno}: {str(w.message)[:60]}"] += 1
        report(f"{config} at B = {args.batch}", engine, reads, *timed, syncs)


def timed_pass(engine: Engine, groups: list, mode: str, budget, reads: list) -> tuple[float, list]:
    """One generate call per group, `reads` cleared first; (wall seconds, [(start, first read
    index, end, end read index)] per call)."""
    reads.clear()
    start, calls = time.perf_counter(), []
    for group in groups:
        calls.append((time.perf_counter(), len(reads)))
        engine.generate(group, 128, mode=mode, budget=budget)
        calls[-1] += (time.perf_counter(), len(reads))
    return time.perf_counter() - start, calls


def report(title: str, engine: Engine, reads: list, wall: float, calls: list, syncs: Counter) -> None:
    """Intervals between reads of one shape, keyed by the plan and by the reads of that shape in a
    row before it (1, 2, 3, 4+: how far into a run of one size the read lies)."""
    spans, switches = defaultdict(list), defaultdict(list)
    first = [reads[i][0] - t0 for t0, i, _, j in calls if j > i]  # start to first read (admit, prefill)
    last = [t1 - reads[j - 1][0] for _, i, t1, j in calls if j > i]  # last read to the call's end
    starts = {i for _, i, _, _ in calls}
    run = 0
    for k, (before, now) in enumerate(zip(reads, reads[1:])):
        if k + 1 in starts:
            run = 0
            continue  # across two calls: the next call's admission and prefill lie between
        run = run + 1 if before[1:3] == now[1:3] else 0
        if before[1:3] == now[1:3] and not now[5] and not before[5]:
            spans[(now[1], now[2], bool(now[3]), bool(now[4]), bool(before[3]), bool(before[4]), min(run, 4))].append(
                now[0] - before[0])
        elif before[1:3] != now[1:3]:
            switches[(before[2], now[2])].append(now[0] - before[0])
    print(f"{title}: wall {wall * 1e3:.0f} ms, {len(reads)} reads; intervals between reads of one shape (bucket, "
          f"size, features, flush, previous features, previous flush, reads of this shape in a row): median / p90 ms (count)")
    for key, values in sorted(spans.items(), key=lambda kv: -len(kv[1])):
        values.sort()
        print(f"  {key}: {statistics.median(values) * 1e3:.3f} / {values[int(0.9 * (len(values) - 1))] * 1e3:.3f} "
              f"({len(values)})")
    steady_ms = sum(map(sum, spans.values())) * 1e3
    switch_ms = sum(map(sum, switches.values())) * 1e3
    if first:
        print(f"  per call ({len(calls)}): start to first read {sum(first) * 1e3:.1f} ms in all (median "
              f"{statistics.median(first) * 1e3:.2f}), last read to end {sum(last) * 1e3:.1f} ms (median "
              f"{statistics.median(last) * 1e3:.2f})")
    print(f"  steady intervals {steady_ms:.1f} ms in all; after a change of size {switch_ms:.1f} ms over "
          f"{sum(map(len, switches.values()))} reads (size before -> after: median ms, count): "
          + ", ".join(f"{a}->{b}: {statistics.median(v) * 1e3:.3f} ({len(v)})"
                      for (a, b), v in sorted(switches.items(), key=lambda kv: -len(kv[1]))[:8]))
    if engine.sizer is not None:
        print("  correction:", {k: (round(r, 3), n) for k, (r, n) in sorted(engine.sizer.correction.ratios.items())})
    print("  synchronizing calls:", dict(syncs.most_common(8)) or "none reported", flush=True)


if __name__ == "__main__":
    main()
