"""Round graphs captured at start-up for the modes a server will be asked for, so that no request
waits for a compile or a capture (engine/graphs.py: a new plan's first round runs eagerly, compiling
its kernels; its second captures the graph).

A round's plan depends on its batch bucket, its mode and budget, and the batch's sampling flags
(greedy, sampled, sampled with a top-k / top-p cut). For each mode asked for (ar, chain, or ddtree
with a fixed budget), each bucket and each flag set of prefill_graphs.FLAG_SETTINGS, `bucket`
stand-in requests fill slots 0 .. bucket - 1 and take STEPS steps: the eager round, the capture,
replays. Budget auto's shapes (every tree size, plain steps with and without their rows set aside)
are engine/profiling.py's capture_round_graphs, here at each flag set. What stays on the request
path: a drafter context that outgrows scheduling.MIN_GRAPH_KEYS keys takes a new graph each time
its key bound doubles, a batch mixing modes can make a plan of its own, and a fixed budget not
asked for here captures on its first two rounds.
"""

from __future__ import annotations

import logging

import torch

from .prefill_graphs import FLAG_SETTINGS
from .profiling import buckets_up_to, capture_round_graphs, stand_in_geometry, stand_in_prompts, stand_ins
from .sampling import SamplingParams

log = logging.getLogger("ddtree.engine")

STEPS = 4  # the prefill's step launches the eager round; the next captures and replays; two more replay


def default_warm_modes(budget: int | str, has_drafter: bool) -> list[tuple[str, int | str | None]]:
    """What serve warms without --warm-modes: ar, and with a drafter chain and ddtree at the
    server's default budget (auto, or the fixed --budget)."""
    return [("ar", None)] + ([("chain", None), ("ddtree", budget)] if has_drafter else [])


def capture_mode_graphs(engine, modes: list[tuple[str, int | str | None]], *, progress: bool = False) -> list[int]:
    """Capture the round graphs of every mode in `modes` ((mode, budget) pairs: arguments.warm_modes')
    at every batch bucket up to engine.max_batch and every flag set, on an idle engine; returns the
    buckets warmed ([] where rounds have no graphs, as on the CPU). Buckets the KV cache cannot
    fill with stand-ins are left out (logged). Budget auto's greedy shapes are assumed captured
    by the round-cost measurement before this (Engine.measure_round_costs); its sampled ones are
    captured here."""
    if not modes:
        return []
    # a mode or budget this engine refuses raises here, on any device
    nodes = max(engine.node_limit(mode, 1 if budget is None else budget) for mode, budget in modes)
    if engine.graphs is None:
        return []
    if engine.has_unfinished():
        raise RuntimeError("round graphs are captured on an idle engine: finish or abort its requests first")
    engine.drain()
    buckets = buckets_up_to(engine.max_batch, engine.max_batch)
    prefix, new_tokens, fit = stand_in_geometry(engine, None, STEPS + 1, nodes)
    if fit < buckets[-1]:
        log.warning("warming: the KV cache holds %d stand-in requests at once; batch buckets %s warm on the "
                    "request path", fit, [b for b in buckets if b > fit])
    buckets = [b for b in buckets if b <= fit]
    fixed = [pair for pair in modes if pair[1] != "auto"]
    auto = any(pair[1] == "auto" for pair in modes) and engine.sizer is not None
    if auto and engine.sizer.failure is not None:  # its rounds take the smallest tree, greedy shapes uncaptured
        log.warning("warming: budget auto has no round costs (%s): its rounds capture on the request path",
                    engine.sizer.failure)
        auto = False
    from tqdm import tqdm

    bar = tqdm(total=len(buckets) * len(FLAG_SETTINGS) * (len(fixed) + auto), desc="capturing round graphs",
               unit="shape", disable=not progress)
    gen = torch.Generator().manual_seed(0)
    for temperature, top_k in FLAG_SETTINGS:
        params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True, temperature=temperature, top_k=top_k,
                                seed=0)
        for bucket in buckets:
            for mode, budget in fixed:
                prompts = stand_in_prompts(engine, bucket, prefix, gen)
                _run_stand_ins(engine, prompts, params, mode, budget)
                bar.update(1)
            if auto and temperature > 0 and not capture_round_graphs(engine, [bucket], params=params):
                log.warning("warming: budget auto's stand-ins at batch bucket %d do not fit the KV cache: its "
                            "sampled rounds there capture on the request path", bucket)
            bar.update(int(auto))  # greedy: the measurement's
    bar.close()
    return buckets


def _run_stand_ins(engine, prompts: list[list[int]], params: SamplingParams, mode: str, budget) -> None:
    with stand_ins(engine, prompts, params, mode, 1 if budget is None else budget):
        for _ in range(STEPS - 1):  # after the step that admitted them
            engine.step()
