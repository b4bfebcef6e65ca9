"""Measuring what a step costs: the engine runs itself on stand-in requests, shape by shape.

For every batch bucket, `bucket` requests of random prompt tokens fill slots 0 .. bucket - 1 and
the engine steps them with the tree size forced, one size after another (0: plain decode steps);
each (bucket, size) gets the median wall time of its steps after a warm-up that compiles the
kernels and captures the round's CUDA graphs. A plain step is timed as most of auto's are, leaving
its row out of the drafter's context (engine/sizing.py); its warm-up first runs plain steps that set
their rows aside long enough to append them twice, and a tree's starts with plain steps before trees
twice (a tree after plain steps appends them first), so that these rounds' graphs are captured
here and not on the request path. A step's wall time in steady state is what a user
waits for per round: the device's round, or the host's work when that is longer (overlap on),
graph launches included. The stand-ins teach the sizer's ledger nothing, and they leave:
their slots, pages and statistics are gone when the measurement returns.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import statistics
import time
import uuid

import torch

from .costs import RoundCosts
from .batch import PENDING_ROWS
from .pages import pages_for
from .sampling import SamplingParams
from .scheduling import bucket_for

log = logging.getLogger("ddtree.engine")


def buckets_up_to(count: int, max_batch: int) -> list[int]:
    """The batch buckets a round over at most `count` requests can take: 1, 2, 4 ... (scheduling)."""
    top, buckets, b = bucket_for(max(1, count), max_batch), [], 1
    while b < top:
        buckets.append(b)
        b *= 2
    return buckets + [top]


def prepare_auto_rounds(engine, buckets: list[int], **options) -> list[int]:
    """Before budget auto's rounds at `buckets`: measure the costs the engine's table lacks (into
    it) and capture the graphs of the buckets whose costs came from a kept or given table (each
    would otherwise be an eager round and a capture on the request path). Returns the buckets
    measured. Options: measure_round_costs's."""
    missing = engine.sizer.unmeasured(buckets)
    if missing:
        engine.sizer.add_costs(measure_round_costs(engine, missing, **options), missing)
    if engine.graphs is not None:
        cold = [b for b in buckets if b not in missing and b not in engine.graphs.warm_buckets]
        capture_round_graphs(engine, cold)
        engine.graphs.warm_buckets.update(missing + cold)
    return missing


def measure_round_costs(engine, buckets: list[int], *, prefix: int | None = None, warmup: int = 3,
                        repeats: int = 6, passes: int = 2, progress: bool | None = None) -> RoundCosts:
    """Seconds per step at each bucket in `buckets` and each size of engine.sizer.sizes.

    prefix: prompt tokens of each stand-in (default min(256, max_model_len // 4)); warmup / repeats:
    steps per shape before and in the median; passes: over every size of a bucket (the second in
    reverse order), keeping each size's lowest median, so that a slow spell of the machine does
    not land on one size alone; progress: a bar on stderr (None: once the measurement has taken a second).
    Needs an idle engine: nothing queued or running (Engine.measure_round_costs holds its queue
    back meanwhile)."""
    if engine.sizer is None:
        raise ValueError("round costs are for tree sizes: this engine has no drafter")
    if engine.has_unfinished():
        raise RuntimeError("round costs are measured on an idle engine: finish or abort its requests first")
    engine.drain()  # a round launched after its requests' last tokens: nobody waits for it
    if warmup < 3 or repeats < 1 or passes < 1:
        raise ValueError(f"need warmup >= 3 (compile, capture, first replay), repeats >= 1 and passes >= 1, "
                         f"got {warmup}, {repeats}, {passes}")
    prefix, new_tokens, fit = stand_in_geometry(engine, prefix, max(len(_warm_sizes(s, warmup)) for s in (0, 1)) + repeats)
    if fit < 1:
        raise ValueError(f"the KV cache (num_pages={engine.blocks.num_pages} of {engine.page_size} slots) cannot hold "
                         f"one stand-in request to measure round costs ({prefix} + {new_tokens} tokens)")
    skipped = [b for b in buckets if b > fit]
    if skipped:
        log.warning("round costs: the KV cache holds %d stand-in requests at once; batch buckets %s are left "
                    "unmeasured (their rounds use bucket %d's costs)", fit, skipped, max(b for b in buckets if b <= fit))
    buckets = [b for b in buckets if b <= fit]
    sizes = engine.sizer.sizes
    table = RoundCosts(engine.signature, details={"prefix": prefix, "warmup": warmup, "repeats": repeats,
                                                   "passes": passes, "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                                                   "torch": torch.__version__})
    gen = torch.Generator().manual_seed(0)
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True, seed=0)
    start = time.perf_counter()
    log.info("measuring round costs for batch buckets %s x tree sizes %s (budget auto's table; once per pair and "
             "device, then kept)", buckets, list(sizes))
    bar = _bar(len(buckets) * len(sizes) * passes, progress)
    for bucket in buckets:
        row = table.seconds.setdefault(bucket, {})
        for p in range(passes):
            for size in sizes if p % 2 == 0 else sizes[::-1]:
                prompts = stand_in_prompts(engine, bucket, prefix, gen)
                seconds, tokens = _time_steps(engine, prompts, params, size, warmup, repeats)
                if seconds < row.get(size, float("inf")):
                    row[size] = seconds
                    table.tokens.setdefault(bucket, {})[size] = tokens
                bar.update(1)
    bar.close()
    log.info("measured round costs for batch buckets %s x tree sizes %s in %.1f s", buckets, list(sizes),
             time.perf_counter() - start)
    return table


def capture_round_graphs(engine, buckets: list[int], *, warmup: int = 3,
                         params: SamplingParams | None = None) -> list[int]:
    """Capture the CUDA graphs of budget auto's rounds at each bucket in `buckets` (plain steps
    with and without their rows set aside, every tree size with and without an append), as
    measure_round_costs does for the buckets it times: for buckets whose costs come from a kept
    or given table. Stand-in requests, as there, greedy unless `params` (its sampling settings;
    its length and stops are replaced); returns the buckets captured (those the KV cache can
    fill)."""
    if not buckets:
        return []
    engine.drain()
    prefix, new_tokens, fit = stand_in_geometry(engine, None, max(len(_warm_sizes(s, warmup)) for s in (0, 1)) + 1)
    buckets = [b for b in buckets if b <= fit]
    start, gen = time.perf_counter(), torch.Generator().manual_seed(0)
    params = dataclasses.replace(params or SamplingParams(seed=0), max_new_tokens=new_tokens, ignore_eos=True,
                                 stop=(), stop_token_ids=())  # every stand-in runs every step
    for bucket in buckets:
        for size in engine.sizer.sizes:
            prompts = stand_in_prompts(engine, bucket, prefix, gen)
            _time_steps(engine, prompts, params, size, warmup, 1)
    log.info("captured the round graphs of batch buckets %s x tree sizes %s in %.1f s", buckets,
             list(engine.sizer.sizes), time.perf_counter() - start)
    return buckets


def stand_in_geometry(engine, prefix: int | None, steps: int, nodes: int | None = None) -> tuple[int, int, int]:
    """(prompt tokens, new tokens, stand-ins the KV cache holds at once) for a measurement of
    `steps` steps: new tokens for more than the steps can commit (or what max_model_len leaves),
    the prompt shrunk to fit beside them; nodes: the most tree nodes a round reserves beyond them
    (default: budget auto's largest size)."""
    room = engine.max_model_len
    new_tokens = max(1, min((steps + 2) * (engine.max_depth + 1) + 1, room - 1))
    prefix = max(1, min(prefix or 256, max(1, room // 4), room - new_tokens))
    per = pages_for(prefix + new_tokens + (engine.sizer.largest if nodes is None else nodes), engine.page_size)
    blocks = engine.blocks
    fit = 0 if per > blocks.table.shape[1] else min(engine.max_batch, blocks.num_pages // per)
    return prefix, new_tokens, fit


def _time_steps(engine, prompts: list[list[int]], params: SamplingParams, size: int, warmup: int,
                repeats: int) -> tuple[float, float]:
    """(seconds of a step, tokens a timed step committed on average)."""
    sizer = engine.sizer
    sizer.forced = size
    try:
        with stand_ins(engine, prompts, params, "ddtree", "auto"):
            times, tokens = [], []
            last = time.perf_counter()
            warm = _warm_sizes(size, warmup)
            for i, forced in enumerate(warm + [size] * repeats):
                sizer.forced = forced
                # plain warm-up steps set rows aside (their graphs, the append's); the last ones and the timed ones do not
                sizer.forced_set_aside = not (size == 0 and i >= len(warm) - warmup)
                outputs = engine.step()
                now = time.perf_counter()
                times.append(now - last)
                tokens.append(sum(len(o.new_token_ids) for o in outputs))
                last = now
            times, tokens = times[-repeats:], tokens[-repeats:]
            return statistics.median(times), statistics.mean(tokens)
    finally:
        sizer.forced, sizer.forced_set_aside = None, True


def stand_in_prompts(engine, count: int, length: int, gen: torch.Generator) -> list[list[int]]:
    """`count` random prompts of `length` token ids of the target's vocabulary, drawn from `gen`."""
    vocab = engine.target.cfg.vocab_size
    return [torch.randint(0, vocab, (length,), generator=gen).tolist() for _ in range(count)]


@contextlib.contextmanager
def stand_ins(engine, prompts: list[list[int]], params: SamplingParams, mode: str, budget: int | str):
    """`prompts` as stand-in requests of `mode` and `budget` (ids no user request can hold), all
    admitted and prefilled by one step that also launches their first round; aborted and the
    engine drained when the block ends. A RuntimeError if the KV cache cannot admit them at once
    (fewer would run another batch bucket)."""
    ids = []
    try:
        for p in prompts:
            ids.append(engine.add_request(p, params, mode=mode, budget=budget,
                                          request_id=f"ddtree-stand-in-{uuid.uuid4().hex}"))
        engine.step()
        if engine.num_running != len(prompts):
            raise RuntimeError(f"only {engine.num_running} of {len(prompts)} stand-in requests fit in the KV cache "
                               f"at once (num_pages={engine.blocks.num_pages}) for a batch of {len(prompts)}")
        yield
    finally:
        for request_id in ids:
            engine.abort(request_id)
        engine.drain()


def _warm_sizes(size: int, warmup: int) -> list[int]:
    """The forced sizes of a shape's warm-up steps (see the module's docstring)."""
    if size == 0:
        return [0] * (2 * PENDING_ROWS + 1 + warmup)
    return [0, size, 0, size] + [size] * warmup


def _bar(total: int, enabled: bool | None):
    """A progress bar on stderr; None: shown once the measurement has taken a second."""
    from tqdm import tqdm

    return tqdm(total=total, desc="measuring round costs", unit="shape", disable=enabled is False,
                delay=1.0 if enabled is None else 0.0)
