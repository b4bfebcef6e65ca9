"""A request's life on the host: its settings, committed tokens, stop checks and statistics."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from .sampling import SamplingParams
from .text import TextStream
from .timing import STAGES

MODES = ("ar", "chain", "ddtree")


@dataclass
class GenerationStats:
    """rounds: rounds after the prefill; acceptance_lengths: tokens committed per round (accepted
    nodes + the bonus; 1 in ar), so 1 + sum == len(token_ids); tokens_per_s: generated tokens over
    the time from the request's prefill to its end; stage_seconds: time of the rounds it took part
    in, per stage (a batched round's time counts for each of its requests); experts_touched: per
    round, per MoE layer, the distinct routed experts its verify rows touched (None without MoE);
    tree_sizes: per round, the tree nodes it verified (0: a plain decode step; budget="auto"
    chooses it each round)."""

    rounds: int = 0
    acceptance_lengths: list[int] = field(default_factory=list)
    tokens_per_s: float = 0.0
    stage_seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(STAGES, 0.0))
    experts_touched: list[list[int]] | None = None
    tree_sizes: list[int] = field(default_factory=list)

    def add_round(self, committed: int, tree_size: int, seconds: dict[str, float], experts: list[int] | None) -> None:
        """One round read back: tokens it kept, nodes it verified, stage times, experts per layer."""
        self.rounds += 1
        self.acceptance_lengths.append(committed)
        self.tree_sizes.append(tree_size)
        for stage, s in seconds.items():
            self.stage_seconds[stage] += s
        if self.experts_touched is not None and experts is not None:
            self.experts_touched.append(experts)

    @property
    def mean_acceptance_length(self) -> float:
        n = len(self.acceptance_lengths)
        return sum(self.acceptance_lengths) / n if n else 0.0


def node_limit_for(mode: str, budget, max_budget: int, max_depth: int, auto_nodes: int | None) -> int:
    """The most tree nodes a round may verify for a request of `mode` and `budget`, after checking
    both: 0 for ar, D for chain, the budget for ddtree (auto_nodes, the largest size budget="auto"
    may choose, for "auto"; None: no drafter)."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if mode != "ar" and auto_nodes is None:
        raise ValueError(f"mode {mode!r} needs a drafter; this engine has none (use mode='ar')")
    if mode != "ddtree":
        return 0 if mode == "ar" else max_depth
    if budget == "auto":
        return auto_nodes
    if isinstance(budget, bool) or not isinstance(budget, int) or not 1 <= budget <= max_budget:
        raise ValueError(f'budget must be "auto" or an int in [1, max_budget={max_budget}], got {budget!r}')
    return budget


@dataclass
class RequestOutput:
    """The result of one finished request: new tokens only (a stop token included), the text
    (None without a tokenizer; stop strings cut out), why it ended, its seed and statistics."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str | None
    finish_reason: str  # "stop" or "length"
    seed: int
    stats: GenerationStats


@dataclass
class StepOutput:
    """What one step committed for one request: the tokens, the text delta, and whether it ended."""

    request_id: str
    new_token_ids: list[int]
    new_text: str | None
    finished: bool
    finish_reason: str | None


class Request:
    def __init__(self, request_id: str, prompt_ids: list[int], params: SamplingParams, mode: str, budget: int | str,
                 node_limit: int, stop_ids: frozenset[int], tokenizer):
        """budget: an int, or "auto" (mode ddtree: the engine sizes each round's tree, engine/sizing.py);
        node_limit: the most tree nodes a round may verify for it (0 ar, D chain)."""
        self.id = request_id
        self.prompt_ids = prompt_ids
        self.params = params
        self.mode = mode
        self.budget = budget
        self.node_limit = node_limit
        self.stop_ids = stop_ids
        self.text = TextStream(tokenizer, params.stop) if tokenizer is not None else None
        self.output: list[int] = []
        self.slot: int | None = None
        self.prefix_len = 0  # host mirror of the cache's committed entries
        self.pending_rows = 0  # at most the rows its slot holds set aside for the drafter (engine/batch.py)
        self.accepted_nodes = 0.0  # budget "auto": tree nodes it had accepted, and what the pooled
        self.expected_nodes = 0.0  # rates expected of the same rounds (engine/sizing.py)
        self.finish_reason: str | None = None
        self.awaiting_first = False  # prefilled, its first token not yet read back (engine/stepping.py)
        self.stats = GenerationStats()
        self.started = 0.0
        self.ended = 0.0

    @property
    def auto(self) -> bool:
        """The engine chooses this request's tree size every round."""
        return self.mode == "ddtree" and self.budget == "auto"

    def remaining_tokens(self) -> int:
        """Tokens it may still commit, as the host has seen so far (the first counted once prefilled)."""
        return self.params.max_new_tokens - len(self.output) - self.awaiting_first

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def worst_rows(self) -> int:
        """The most cache slots this request can ever need: its longest prefix before the last
        round (prompt + max_new_tokens - 1) plus one verify's rows (node_limit + 1)."""
        return len(self.prompt_ids) + self.params.max_new_tokens + self.node_limit

    def commit(self, tokens: list[int]) -> list[int]:
        """Append tokens committed by the target, stopping at a stop token, a stop string or
        max_new_tokens; returns the tokens kept (the rest of the path is discarded)."""
        kept = tokens[: self.params.max_new_tokens - len(self.output)]
        if not kept:
            return kept
        stop_token = next((i for i, token in enumerate(kept) if token in self.stop_ids), None)
        if stop_token is not None:
            kept = kept[: stop_token + 1]
        stopped = stop_token is not None
        if self.text is not None:  # the text of every token kept, up to the one that completes a stop string
            taken = self.text.extend(kept)
            if self.text.stopped:
                kept, stopped = kept[:taken], True
        self.output.extend(kept)
        if stopped:
            self.finish_reason = "stop"
        elif len(self.output) >= self.params.max_new_tokens:
            self.finish_reason = "length"
        if self.finished:
            self.ended = time.perf_counter()
        return kept

    def step_output(self, kept: list[int]) -> StepOutput:
        delta = self.text.delta(final=self.finished) if self.text is not None else None
        return StepOutput(self.id, kept, delta, self.finished, self.finish_reason)

    def result(self) -> RequestOutput:
        elapsed = self.ended - self.started
        self.stats.tokens_per_s = len(self.output) / elapsed if elapsed > 0 else 0.0
        text = self.text.text if self.text is not None else None
        return RequestOutput(self.id, self.prompt_ids, list(self.output), text, self.finish_reason, self.params.seed,
                             self.stats)
