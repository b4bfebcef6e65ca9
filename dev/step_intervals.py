"""The wall time between an engine's consecutive reads of rounds of one shape, by plan (size, drafter
rows set aside, appended), for the demo pair in groups of B (auto_budget's schedule): what the
sizer's step correction sees, `ar` beside auto. Also counts the synchronizing calls torch reports
(torch.cuda.set_sync_debug_mode) during the timed pass.

    python dev/step_intervals.py --batch 32 --configs ar ddtree,auto
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
        for group in groups:  # warm-up pass
            engine.generate(group, 128, mode=mode, budget=budget)
        reads.clear()
        syncs = Counter()
        if cuda:
            torch.cuda.set_sync_debug_mode("warn")
        start = time.perf_counter()
        calls = []  # (start, first read index, end) of each generate call
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for group in groups:
                calls.append((time.perf_counter(), len(reads)))
                engine.generate(group, 128, mode=mode, budget=budget)
                calls[-1] += (time.perf_counter(), len(reads))
        wall = time.perf_counter() - start
        if cuda:
            torch.cuda.set_sync_debug_mode(0)
        for w in caught:
            syncs[f"{Path(w.filename).name}:{w.lineno}: {str(w.message)[:60]}"] += 1
        spans, switches = defaultdict(list), defaultdict(list)
        first = [reads[i][0] - t0 for t0, i, _, j in calls if j > i]  # start to first read (admit, prefill)
        last = [t1 - reads[j - 1][0] for _, i, t1, j in calls if j > i]  # last read to the call's end
        starts = {i for _, i, _, _ in calls}
        for k, (before, now) in enumerate(zip(reads, reads[1:])):
            if k + 1 in starts:
                continue  # across two calls: the next call's admission and prefill lie between
            if before[1:3] == now[1:3] and not now[5] and not before[5]:
                spans[(now[1], now[2], now[3], now[4], before[3], before[4])].append(now[0] - before[0])
            elif before[1:3] != now[1:3]:
                switches[(before[2], now[2])].append(now[0] - before[0])
        print(f"{config} at B = {args.batch}: wall {wall * 1e3:.0f} ms, {len(reads)} reads; intervals between reads of "
              f"one shape (bucket, size, features, flush, previous features, previous flush): median / p90 ms (count)")
        for key, values in sorted(spans.items(), key=lambda kv: -len(kv[1])):
            values.sort()
            print(f"  {key}: {statistics.median(values) * 1e3:.3f} / {values[int(0.9 * (len(values) - 1))] * 1e3:.3f} "
                  f"({len(values)})")
        steady_ms = sum(map(sum, spans.values())) * 1e3
        switch_ms = sum(map(sum, switches.values())) * 1e3
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
