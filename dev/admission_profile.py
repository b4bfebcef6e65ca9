"""Where the time of admissions goes under continuous batching: the demo pair, one generate call of
N prompts on an engine of max_batch B (a finished request's slot refilled at once), the timed
pass split into Engine.step's parts (admit + prefill, launch, collect), admissions counted, and
cProfile's functions by cumulative time (the host's view of each prefill); --torch-profile adds
torch.profiler's operators of one more pass by self CPU time (launches beside waits: cudaStreamSynchronize,
cudaMemcpyAsync, aten::item / _local_scalar_dense) and by device time.

    python dev/admission_profile.py --batch 32 --prompts 120 --configs ar,1 ddtree,8 [--torch-profile]
"""

from __future__ import annotations

import argparse
import pstats
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "dev"))

from ddtree import Engine  # noqa: E402
from demo_step_profile import demo_prompts, timed_parts, timed_run  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--prompts", type=int, default=120)
    parser.add_argument("--configs", nargs="+", default=["ar,1", "ddtree,8"])
    parser.add_argument("--torch-profile", action="store_true")
    args = parser.parse_args()
    prompts = demo_prompts(args.prompts)
    engine = Engine.from_pretrained(max_batch=args.batch, max_budget=64, kept_costs="off")
    ids = [engine.tokenize(p) for p in prompts]  # token ids: the text's encoding is no part of a step
    spent = timed_parts(engine)
    admissions = []
    prefill = engine.worker.prefill

    def counted(table, slots, *rest):
        admissions.append(len(slots))
        with torch.profiler.record_function("admission prefill"):  # its row: the whole prefill's host time
            return prefill(table, slots, *rest)

    engine.worker.prefill = counted
    for config in args.configs:
        mode, budget = config.split(",")
        engine.generate(ids, 128, mode=mode, budget=int(budget))
        for profiled in (False, True):
            admissions.clear()
            wall, _, profile = timed_run(engine, spent, lambda: engine.generate(ids, 128, mode=mode, budget=int(budget)),
                                         profiled)
            print(f"{config}{' (cProfile)' if profiled else ''}: wall {wall * 1e3:.0f} ms, admit {spent['admit'] * 1e3:.0f}, "
                  f"launch {spent['launch'] * 1e3:.0f}, collect {spent['collect'] * 1e3:.0f}; {len(admissions)} prefills "
                  f"of {sum(admissions)} prompts (admit per prefill {spent['admit'] * 1e3 / max(1, len(admissions)):.2f} ms)",
                  flush=True)
            if profiled:
                pstats.Stats(profile).sort_stats("cumulative").print_stats(28)
        if args.torch_profile:
            torch_profile(engine, lambda: engine.generate(ids, 128, mode=mode, budget=int(budget)), config)


def torch_profile(engine, run, config: str) -> None:
    activities = [torch.profiler.ProfilerActivity.CPU]
    if engine.device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
        torch.cuda.synchronize()
    with torch.profiler.profile(activities=activities) as prof:
        run()
    events = prof.key_averages()
    print(f"{config} (torch.profiler), by self CPU time:")
    print(events.table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=60))
    if engine.device.type == "cuda":
        print(f"{config} (torch.profiler), by device time:")
        print(events.table(sort_by="self_device_time_total", row_limit=20, max_name_column_width=60))


if __name__ == "__main__":
    main()
