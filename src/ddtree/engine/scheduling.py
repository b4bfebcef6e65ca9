"""Host-side choices for a step: the round's plan from its requests, and per-prompt settings."""

from __future__ import annotations

from dataclasses import dataclass

from .batch import PENDING_ROWS
from .request import Request
from .round import RoundPlan
from .sampling import SamplingParams


def bucket_for(slots_used: int, max_batch: int) -> int:
    """The batch size a round runs at: the next power of two >= slots_used, at most max_batch."""
    bucket = 1
    while bucket < slots_used:
        bucket *= 2
    return min(bucket, max_batch)


def generation_params(params: list[SamplingParams]) -> tuple[bool, bool]:
    """(some request samples, some request cuts by top-k / top-p)."""
    sampled = [p for p in params if p.temperature > 0]
    return bool(sampled), any(p.top_k > 0 or p.top_p < 1 for p in sampled)


@dataclass(frozen=True)
class PlanLimits:
    """What a round's plan depends on besides its requests; the engine makes it once.
    drafter_capacity: keys a slot's drafter context holds (0 without a drafter); graphed: rounds
    replay CUDA graphs (engine/graphs.py), so the drafter's key bound is rounded for them."""

    max_batch: int
    max_depth: int
    vocab_size: int
    moe: bool
    drafter_capacity: int = 0
    graphed: bool = False


MIN_GRAPH_KEYS = 1024  # graphed rounds over contexts shorter than this share one graph per shape


def key_bound(longest: int, limits: PlanLimits) -> int:
    """The bound on a round's drafter keys for a longest context + block of `longest` keys: rounded
    up to 64 keys (eager), or, for a graphed round, to the next power of two of at least
    MIN_GRAPH_KEYS, so that a growing context needs a new graph only when its length doubles and
    short ones none at all (each new graph is an eager round and a capture on the request path);
    never past the drafter's capacity."""
    if not limits.graphed:
        return min(limits.drafter_capacity, -(-longest // 64) * 64)
    bound = MIN_GRAPH_KEYS
    while bound < longest:
        bound *= 2
    return min(bound, limits.drafter_capacity)


def batch_requests(requests: list[Request], limits: PlanLimits, sizer, behind: int = 0, closed: bool = False) -> RoundPlan:
    """The plan of one round over `requests` (each in its slot); behind: tokens a round still in
    flight may have committed beyond the host's prefix lengths. "auto" requests take the size
    `sizer` chooses (at least what the batch's other requests need); closed: the caller waits
    for the whole batch and nothing is queued (TreeSizer.choose)."""
    bucket = bucket_for(max(r.slot for r in requests) + 1, limits.max_batch)
    auto = [r for r in requests if r.auto]
    fixed = [r for r in requests if not r.auto]
    budget = max((r.node_limit for r in fixed), default=0)
    if auto:
        expected = sum(r.stats.mean_acceptance_length or 1.0 for r in fixed)
        budget = sizer.choose(bucket, auto, expected, budget, closed)
    paths = bool(auto) and budget > 0  # what auto requests accepted teaches the sizer
    trees = [r.budget for r in fixed if r.mode == "ddtree"] + ([budget] if paths else [])
    k = min(max(trees), limits.vocab_size) if trees else 1
    sampled, filtered = generation_params([r.params for r in requests])
    key_limit = None
    if budget > 0:  # the drafter runs: read keys up to the longest context + its block
        key_limit = key_bound(max(r.prefix_len for r in requests) + behind + limits.max_depth + 1, limits)
    # "auto" requests keep the drafter's context through the plain steps before a tree (set aside,
    # appended a batch of rows at a time); other plain steps leave their rows out and cost an ar step.
    features = budget > 0 or (bool(auto) and sizer.set_aside)
    if budget == 0:
        flush = features and any(r.pending_rows + 1 >= PENDING_ROWS for r in requests)
    else:
        flush = any(r.pending_rows > 0 for r in requests)
    if flush or (budget == 0 and features):  # the host's count is an upper bound: a slot out of tokens sets nothing aside
        for r in requests:
            r.pending_rows = 0 if flush else r.pending_rows + 1
    return RoundPlan(bucket=bucket, budget=budget, k=k if budget else 0, any_sampled=sampled, any_filtered=filtered,
                     key_limit=key_limit, features=features, experts=limits.moe, paths=paths,
                     flush=flush)


def per_prompt_params(count: int, *, max_new_tokens, temperature, top_p, top_k, seed, stop) -> list[SamplingParams]:
    """SamplingParams for `count` prompts; each setting is one value for all or a list of `count`.

    stop: None, a string, or a list of strings and token ids (ints); per prompt, a list of those.
    """
    def spread(name: str, value, is_list) -> list:
        if is_list(value):
            if len(value) != count:
                raise ValueError(f"{name} has {len(value)} entries for {count} prompts")
            return list(value)
        return [value] * count

    plain_list = lambda v: isinstance(v, (list, tuple))  # noqa: E731
    per_stop = lambda v: isinstance(v, (list, tuple)) and any(isinstance(s, (list, tuple)) or s is None for s in v)  # noqa: E731
    columns = {
        "max_new_tokens": spread("max_new_tokens", max_new_tokens, plain_list),
        "temperature": spread("temperature", temperature, plain_list),
        "top_p": spread("top_p", top_p, plain_list),
        "top_k": spread("top_k", top_k, plain_list),
        "seed": spread("seed", seed, plain_list),
        "stop": spread("stop", stop, per_stop),
    }
    out = []
    for i in range(count):
        row = {name: values[i] for name, values in columns.items()}
        stops = row.pop("stop")
        stops = [] if stops is None else [stops] if isinstance(stops, str) else list(stops)
        strings = tuple(s for s in stops if isinstance(s, str))
        token_ids = tuple(s for s in stops if not isinstance(s, str))
        out.append(SamplingParams(**row, stop=strings, stop_token_ids=token_ids))
    return out
