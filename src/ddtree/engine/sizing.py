"""The tree's size, chosen each round by measured utility (budget="auto").

Each round the host picks one size for the batch's "auto" requests (0 is a plain decode step):
the size of the most committed tokens per second of the whole batch. A size's tokens are what
rounds of that size committed lately, measured in hindsight (engine/acceptance.py); its seconds
are what a step of that size costs at this batch bucket (engine/costs.py's table, corrected by
the wall time of the engine's own steps). This is Cascade's rule (arXiv 2506.20675): measure
what each choice delivers, hold the best, re-test the others now and then, and turn speculation
off where it does not pay. A verify's padding rows cost what real rows cost (they are routed
like any other), so the choice is one size per round.

What is known is kept fresh by exploring, at a bounded cost:
- at first, the largest size until it was verified `start_weight` times: it tells every size;
- on trees, one round `explore_every` tree rounds after the last such takes the next larger
  size, the only way to learn what it would add; one that does not move the choice up doubles
  the gap to the next (up to EXPLORE_BACKOFF times), one that does resets it;
- plain steps whose real cost at this bucket was never seen (the table measures stand-ins, and
  was once far off: docs/notes/auto_budget.md): a burst of `PLAIN_BURST` every `plain_every` tree
  rounds while the table rates them at least PLAIN_TRY_RATE as good as the best (8x rarer once
  seen);
- on plain steps, a probe (the best tree) after `wait` plain steps; each probe doubles the wait
  up to `max_wait`, a tree chosen on its merits resets it. A drafter that keeps failing costs
  at most about (tree cost / plain cost - 1) / max_wait over plain decoding.
When the caller waits for the whole batch (Engine.generate, nothing queued: `closed`), what counts
is when its last request ends, not the tokens per second of each round: trees finish requests at
different rounds and the batch lasts as long as its slowest one. Then the size is the one whose
slowest request is expected to end first, each request's tokens scaled by how its accepted nodes
compared with the pooled rates so far (acceptance.soonest_done).

A plain step keeps its row for the drafter's context (set aside, engine/batch.py) only within
PENDING_ROWS steps of a tree it knows of (a probe, or a burst's end); the others cost what an `ar`
step costs and leave their rows out of the context, whose keys keep their true positions.

The choice is host arithmetic on values already read back: no new synchronization.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np

from .acceptance import AcceptanceLedger, soonest_done
from .batch import PENDING_ROWS
from .costs import RoundCosts, StepCorrection, check_signature
from .round import result_width
from .sizer_state import HeldChoice, SizerState

DEFAULT_TREE_SIZES = (1, 2, 4, 8, 16, 32, 64)
PLAIN_BURST = 4  # plain steps in a row: the third and fourth teach the correction their cost
HOLD_ROUNDS = 4  # a tree size chosen holds this many rounds while its batch stays as it was
EXPLORE_BACKOFF = 8  # explorations of the next larger size that keep failing come at most 8x rarer
PLAIN_TRY_RATE = 0.75  # the table's plain step is tried while it rates them at least 3/4 of the best tree


def best_size(sizes: list[int], seconds: list[float], tokens: list[float]) -> int:
    """The size of the greatest tokens / seconds (ties to the smaller size). sizes ascending;
    seconds > 0 and tokens the batch's expected tokens, one of each per size."""
    if not sizes or not len(sizes) == len(seconds) == len(tokens):
        raise ValueError(f"need one cost and one token count per size, got {len(sizes)} sizes, "
                         f"{len(seconds)} costs, {len(tokens)} token counts")
    rate = np.asarray(tokens, dtype=np.float64) / np.asarray(seconds, dtype=np.float64)
    return sizes[int(np.argmax(rate))]  # argmax takes the first maximum: the smaller size


def tree_sizer(tree_sizes: tuple[int, ...], max_budget: int, max_depth: int, round_costs, signature: dict) -> "TreeSizer":
    """Engine's TreeSizer: the sizes within max_budget, and round_costs as given (a RoundCosts, a
    JSON path, checked against the engine's pair_signature, or None)."""
    sizes = tuple(s for s in tree_sizes if s <= max_budget)
    if not sizes:
        raise ValueError(f"no tree size in {tuple(tree_sizes)} is within max_budget={max_budget}")
    if isinstance(round_costs, (str, Path)):
        round_costs = RoundCosts.load(round_costs, signature)
    elif round_costs is not None:
        check_signature(round_costs.signature, signature, "round_costs")
    return TreeSizer(sizes, max_depth, round_costs)


class TreeSizer:
    """Chooses the size of each round that holds "auto" requests; learns from what rounds commit."""

    def __init__(self, tree_sizes: tuple[int, ...], max_depth: int, costs: RoundCosts | None = None, *,
                 first_wait: int = 4, max_wait: int = 64, explore_every: int = 16, plain_every: int = 64,
                 start_weight: float = 3.0, memory: float = 64.0):
        """tree_sizes: the positive sizes a round may take, ascending; max_depth: the drafter's
        block depth D; costs: the measured table (None until measured: rounds then take the
        smallest tree); the rest: the exploration above and the ledger's memory in rounds."""
        if not tree_sizes or list(tree_sizes) != sorted(set(tree_sizes)) or tree_sizes[0] < 1:
            raise ValueError(f"tree_sizes must be distinct positive ints in ascending order, got {tree_sizes!r}")
        self.tree_sizes, self.max_depth = tuple(tree_sizes), max_depth
        self.first_wait, self.max_wait = first_wait, max_wait
        self.explore_every, self.plain_every, self.start_weight, self.memory = explore_every, plain_every, start_weight, memory
        self.state = self.fresh_state()
        self.costs = costs
        self.forced: int | None = None  # a fixed size for every round (cost measurement)
        self.forced_set_aside = True  # with a forced size: plain steps keep their rows for the drafter
        self.set_aside = True  # the last plain step chosen keeps its rows for the drafter
        self.skipped: set[int] = set()  # buckets the KV cache could not measure (nearest measured one used)
        self.failure: str | None = None  # why no measurement could run (then: the smallest tree)

    def fresh_state(self) -> SizerState:
        """A state that knows nothing yet."""
        return SizerState(AcceptanceLedger(self.largest, self.memory), wait=self.first_wait,
                          explore_at=self.explore_every, explore_gap=self.explore_every)

    @property
    def largest(self) -> int:
        """The largest size an auto round may take (an auto request's node limit)."""
        return self.tree_sizes[-1]

    @property
    def sizes(self) -> tuple[int, ...]:
        """Every size a round of "auto" requests may take, plain steps (0) included."""
        return (0,) + self.tree_sizes

    @property
    def correction(self) -> StepCorrection:
        return self.state.correction

    @correction.setter
    def correction(self, correction: StepCorrection) -> None:
        self.state.correction = correction

    @property
    def costs(self) -> RoundCosts | None:
        return self._costs

    @costs.setter
    def costs(self, table: RoundCosts | None) -> None:
        self._costs = table
        self.state.correction = StepCorrection()  # its ratios are over this table's predictions
        self.state.held = None
        self._rows: dict = {}  # (bucket, floor) -> the candidates and their seconds in the table

    def unmeasured(self, buckets: list[int]) -> list[int]:
        """The buckets of `buckets` the cost table lacks a size of (and that could be measured)."""
        return [b for b in buckets if b not in self.skipped and (self.costs is None or not self.costs.has(b, self.sizes))]

    def add_costs(self, table: RoundCosts, asked: list[int] = ()) -> None:
        """Take a measured table; buckets asked for and not in it could not be measured."""
        self.skipped.update(b for b in asked if b not in table.seconds)
        if self.costs is None:
            self.costs = table
        else:
            self.costs.merge(table)
            self._rows = {}

    def choose(self, bucket: int, auto: list, fixed_tokens: float, floor: int, closed: bool = False) -> int:
        """The round's size for `auto` requests (engine Requests) in a batch whose other requests
        need at least `floor` nodes and are expected to commit `fixed_tokens`; closed: the caller
        waits for the whole batch and nothing is queued (the slowest request's end counts). Sets
        `set_aside` for a plain step."""
        self.set_aside = True
        if self.forced is not None:
            self.set_aside = self.forced_set_aside
            return max(self.forced, floor)
        state = self.state
        key = (bucket, floor, closed, len(auto), min((r.remaining_tokens() for r in auto), default=0) <= self.max_depth + 1)
        held = state.held
        if held is not None and held.key == key and state.burst is None:
            # A choice holds while its batch stays as it was (bucket, requests, switches, none
            # about to end): a plain run until its probe (fewer tokens left favour it more), a tree
            # for HOLD_ROUNDS rounds, its exploration and plain bursts kept on their clocks.
            if held.size == 0 and state.plain_steps + 1 < state.wait:
                state.plain_steps += 1
                self.set_aside = held.probe and state.wait - state.plain_steps < PENDING_ROWS
                return 0
            if held.size > 0 and held.rounds_left > 0:
                state.held = dataclasses.replace(held, rounds_left=held.rounds_left - 1)
                return self._take_tree(bucket, held.size, held.larger, held.rates)
        state.held = None
        candidates, table = self._row(bucket, floor)
        if table is None or len(candidates) == 1:
            return next(s for s in candidates if s > 0)  # nothing measured: the cheapest tree
        if state.burst is not None:
            size, left = state.burst
            state.burst = (size, left - 1) if left > 1 else None
            if size in candidates:
                return size
        ledger = state.ledger
        top = max(s for s in candidates if s <= ledger.largest)
        if ledger.weight(top) < self.start_weight:
            return top  # learn every size at once
        known = [s for s in candidates if s <= ledger.frontier]
        seconds = [table[candidates.index(s)] * state.correction.ratio(bucket, s) for s in known]
        caps = np.fromiter((r.remaining_tokens() for r in auto), np.float64, len(auto))
        # a request commits at most what it has left: [requests, sizes] summed over requests
        tokens = (fixed_tokens + np.minimum(ledger.tokens_of(known)[None, :], caps[:, None]).sum(0)).tolist()
        may_probe = True
        if closed and floor == 0 and fixed_tokens == 0:
            size, may_probe = soonest_done(ledger, known, seconds, auto, caps)
        else:
            size = best_size(known, seconds, tokens)
        if size == 0:
            size = self._plain_or_probe(bucket, known, seconds, tokens, caps, may_probe)
            if size == 0:
                state.held = HeldChoice(key, 0, probe=may_probe)
            return size
        state.plain_steps, state.wait = 0, self.first_wait
        state.judge_exploration(size, self.explore_every, EXPLORE_BACKOFF * self.explore_every)
        larger = next((s for s in candidates if s > size), None)
        # the burst check's rates per auto request, uncapped: what it learns is for rounds to come
        rates = (1.0 / seconds[0], ledger.tokens(size) / seconds[known.index(size)]) if 0 in known else None
        state.held = HeldChoice(key, size, larger, HOLD_ROUNDS - 1, rates)
        return self._take_tree(bucket, size, larger, rates)

    def _take_tree(self, bucket: int, size: int, larger: int | None, rates: tuple[float, float] | None) -> int:
        """A tree round of `size` chosen (or held): the next larger size instead when an exploration
        is due, and a plain burst when one is (rates: plain and this size's, per s)."""
        state = self.state
        state.rounds += 1
        if larger is not None and state.rounds >= state.explore_at and state.explored is None:  # the last one judged
            state.explore_at, state.explored = state.rounds + state.explore_gap, larger  # judged: not learned yet
            return larger
        if rates is not None and self._plain_due(bucket, *rates):
            state.plain_tried[bucket] = state.rounds
            state.burst = (0, PLAIN_BURST - 1)
            state.held = None
            return 0
        return size

    def _plain_due(self, bucket: int, plain_rate: float, best_rate: float) -> bool:
        """Whether a burst of plain steps should run now, to learn their real cost at `bucket`."""
        state = self.state
        every = self.plain_every * (8 if state.correction.seen(bucket, 0) else 1)
        return plain_rate >= PLAIN_TRY_RATE * best_rate and state.rounds - state.plain_tried.get(bucket, 0) >= every

    def _plain_or_probe(self, bucket: int, known: list[int], seconds: list[float], tokens: list[float],
                        caps: np.ndarray, may_probe: bool = True) -> int:
        """A plain step, or when the plain run's wait is over a probe (the best tree by rate); a
        closed batch's trees expected far from paying (may_probe False) skip it, the wait doubling."""
        state = self.state
        state.plain_steps += 1
        if not may_probe and state.plain_steps >= state.wait:
            state.plain_steps, state.wait = 0, min(2 * state.wait, self.max_wait)
        if state.plain_steps < state.wait or caps.max(initial=0) <= 1 or not may_probe:
            # the drafter needs the rows of the steps just before the probe; a request about to end none
            self.set_aside = may_probe and state.wait - state.plain_steps < PENDING_ROWS and caps.max(initial=0) > 1
            return 0
        state.plain_steps, state.wait = 0, min(2 * state.wait, self.max_wait)
        trees = [i for i, s in enumerate(known) if s > 0]
        probe = best_size([known[i] for i in trees], [seconds[i] for i in trees], [tokens[i] for i in trees])
        if not state.correction.seen(bucket, probe):
            state.burst = (probe, 1)  # a second round teaches the correction its cost
        return probe

    def observe_step(self, bucket: int, size: int, seconds: float) -> None:
        """A real step of `size` at `bucket` took `seconds` of wall time: teach the correction how
        far the table was off."""
        if self.forced is not None or self.costs is None:
            return
        candidates, table = self._row(bucket, 0)
        if table is not None and size in candidates:
            correction = self.state.correction
            before = correction.ratio(bucket, size)
            correction.observe(bucket, size, seconds, float(table[candidates.index(size)]))
            if abs(correction.ratio(bucket, size) - before) > 0.02 * before:
                self.state.held = None  # a cost the held choice was made on moved: choose again

    def learn(self, requests: list, slots: list[int], result: np.ndarray, plan, moe_layers: int) -> None:
        """Read a tree round's result (int64 [bucket, round.result_width]) for its "auto" requests
        (engine Requests, in `slots` during that round) into the ledger, and into each request's
        accepted and expected nodes."""
        if not plan.paths or not requests:
            return
        rows = result[slots]
        committed = rows[:, 0].tolist()
        rows = rows[rows[:, 0] >= 1]  # a slot out of tokens sat the round out
        ledger = self.state.ledger
        start = result_width(self.max_depth, moe_layers if plan.experts else 0)  # the paths' columns follow
        ledger.observe(rows[:, start : start + self.max_depth + 1], rows[:, 0], plan.budget)
        if self.state.explored is not None and plan.budget >= self.state.explored:
            self.state.explore_learned = True  # the exploration's evidence is in: a choice may judge it
        # Expected from the ledger with this round in it (1 / memory of its weight): one
        # computation of the rates shared with the next choice.
        verified = min(plan.budget, ledger.largest)
        if 0 < verified <= ledger.frontier:
            expected = ledger.tokens(verified) - 1.0
            for request, tokens in zip(requests, committed):
                if tokens >= 1:
                    request.accepted_nodes += tokens - 1
                    request.expected_nodes += expected

    def _measured_bucket(self, bucket: int) -> int:
        """`bucket`, or the nearest measured one (the next larger first)."""
        measured = self.costs.buckets()
        return bucket if bucket in measured else min((b for b in measured if b > bucket), default=max(measured))

    def _row(self, bucket: int, floor: int) -> tuple[list[int], list[float] | None]:
        """(the sizes a round may take above `floor`, their seconds at `bucket`), from the nearest
        measured bucket (the next larger first) when this one was not measured; no seconds
        without a table."""
        key = (bucket, floor)
        if key not in self._rows:
            candidates = sorted({s for s in self.sizes if s >= floor} | {floor})
            seconds = None
            if self.costs is not None and self.costs.seconds:
                use = self._measured_bucket(bucket)
                try:
                    seconds = [self.costs.cost(use, s) for s in candidates]
                except KeyError:
                    pass
            self._rows[key] = (candidates, seconds)
        return self._rows[key]
