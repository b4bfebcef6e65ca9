"""The tree's size, chosen each round by measured cost (budget="auto").

Each round the host picks one size for the batch (every "auto" request verifies that many nodes;
0 is a plain decode step): the size whose round commits the most expected tokens per second of
the whole batch, from the measured cost of a step at this batch bucket (engine/costs.py) and each
request's expected tokens at each size (engine/forecast.py). A verify's padding rows cost what
real rows cost (they are routed like any other row), so a request in a round of size n takes all
n nodes. The choice is host arithmetic on values already read back: no new synchronization.

The table was measured on stand-ins, and real steps can cost more or less: a MoE target's real
trees touch more experts than stand-ins' do, and the host's work (committing, detokenizing,
streaming) grows with the tokens a step commits, hidden behind the device's round while it is
shorter (overlap) and adding to it past that. How far real steps are from the table is learned
from the engine's own steps (costs.StepCorrection) and multiplies the table's seconds.

A request kept on plain steps learns nothing new about its drafter, so now and then it probes:
once the plain steps it took since its last tree cost `wait` times what one probe round (the
smallest tree) costs over a plain step, the round runs the smallest tree. Each probe doubles the
request's wait (up to `max_wait`), and a tree chosen on its merits resets it, so a drafter that
keeps failing costs at most about 1 / max_wait over plain decoding, and one that recovers is
found within a few steps. A new request starts from the wait its predecessors reached.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from .costs import RoundCosts, StepCorrection, check_signature
from .forecast import AcceptanceForecast

DEFAULT_TREE_SIZES = (1, 2, 4, 8, 16, 32, 64)


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

    def __init__(self, tree_sizes: tuple[int, ...], max_depth: int, costs: RoundCosts | None = None,
                 first_wait: float = 4.0, max_wait: float = 64.0):
        """tree_sizes: the positive sizes a round may take, ascending (the largest is also how
        many nodes a round reports path probabilities for); costs: the measured table (None until
        measured: rounds then take the smallest tree)."""
        if not tree_sizes or list(tree_sizes) != sorted(set(tree_sizes)) or tree_sizes[0] < 1:
            raise ValueError(f"tree_sizes must be distinct positive ints in ascending order, got {tree_sizes!r}")
        self.tree_sizes = tuple(tree_sizes)
        self.first_wait, self.max_wait = first_wait, max_wait
        self.costs = costs
        self.wait_prior = first_wait  # where a new request's wait starts: the latest wait set
        self.forecast = AcceptanceForecast(self.info_nodes, max_depth)
        self.forced: int | None = None  # a fixed size for every round (cost measurement)
        self.skipped: set[int] = set()  # buckets the KV cache could not measure (nearest measured one used)
        self.failure: str | None = None  # why no measurement could run (then: the smallest tree)

    @property
    def costs(self) -> RoundCosts | None:
        return self._costs

    @costs.setter
    def costs(self, table: RoundCosts | None) -> None:
        self._costs = table
        self.correction = StepCorrection()  # its ratios are over this table's predictions
        self._drop_lookups()

    def _drop_lookups(self) -> None:
        """Forget what was looked up in the table (it changed)."""
        self._rows: dict = {}  # (bucket, floor) -> the candidates' costs, as looked up in the table
        self._expected: tuple = (None, None)  # (key, each request's expected tokens per candidate)

    @property
    def info_nodes(self) -> int:
        return self.tree_sizes[-1]

    @property
    def sizes(self) -> tuple[int, ...]:
        """Every size a round of "auto" requests may take, plain steps (0) included."""
        return (0,) + self.tree_sizes

    def forget(self) -> None:
        """Drop what the forecast learned (calibration and the pooled prior), as for a new workload;
        requests already running keep their own history."""
        self.forecast = AcceptanceForecast(self.info_nodes, self.forecast.max_depth)

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
            self._drop_lookups()

    def choose(self, bucket: int, auto: list, fixed_tokens: float, floor: int) -> int:
        """The round's size for `auto` requests (engine Requests with a .forecast) in a batch whose
        other requests need at least `floor` nodes and are expected to commit `fixed_tokens`."""
        if self.forced is not None:
            return max(self.forced, floor)
        candidates, seconds = self._row(bucket, floor)
        smallest_tree = next(s for s in candidates if s > 0)
        per_request = self._expected_tokens(auto, candidates)
        if seconds is None or per_request is None:
            size = smallest_tree  # nothing measured or nothing known: the cheapest tree that teaches
        else:
            tokens = fixed_tokens + per_request.sum(0)
            seconds = seconds * [self.correction.ratio(bucket, s) for s in candidates]
            size = best_size(candidates, seconds.tolist(), tokens.tolist())
            if size == 0:
                size = self._probe_or_decode(auto, seconds[0], seconds[candidates.index(smallest_tree)], smallest_tree)
            elif floor == 0:
                for r in auto:
                    r.forecast.wait = self.first_wait  # a tree on its merits
                self.wait_prior = self.first_wait
        if size > 0:
            for r in auto:
                r.forecast.decode_seconds = 0.0  # a tree is coming back: no probe until it is read
        return size

    def observe_step(self, bucket: int, size: int, seconds: float) -> None:
        """A real step of `size` at `bucket` took `seconds` of wall time: teach the correction how
        far the table was off."""
        if self.forced is not None or self.costs is None:
            return
        candidates, table = self._row(bucket, 0)
        if table is not None and size in candidates:
            self.correction.observe(bucket, size, seconds, float(table[candidates.index(size)]))

    def learn(self, requests: list, slots: list[int], result: np.ndarray, plan, moe_layers: int) -> None:
        """Read a tree round's result (int64 [bucket, round.result_width]) for its "auto" requests
        (in `slots` during that round) into their forecasts."""
        if not plan.info_nodes or not requests:
            return
        rows = result[slots]
        took_part = rows[:, 0] >= 1  # a slot out of tokens sat the round out
        if not took_part.any():
            return
        rows = rows[took_part]
        depth, n = self.forecast.max_depth, plan.info_nodes
        start = 2 + depth + (moe_layers if plan.experts else 0)
        self.forecast.observe([r.forecast for r, t in zip(requests, took_part) if t], rows[:, start : start + n],
                              min(plan.budget, n), rows[:, start + n : start + n + depth + 1], rows[:, 0])

    def _probe_or_decode(self, auto: list, decode: float, probe: float, probe_size: int) -> int:
        for r in auto:
            r.forecast.decode_seconds += decode
            r.forecast.wait = r.forecast.wait or self.wait_prior
        due = [r for r in auto if r.forecast.decode_seconds >= r.forecast.wait * (probe - decode)
               and r.remaining_tokens() > 1]  # a request about to end learns nothing it can use
        for r in due:
            r.forecast.wait = self.wait_prior = min(2 * r.forecast.wait, self.max_wait)
        return probe_size if due else 0

    def _expected_tokens(self, auto: list, candidates: list[int]) -> np.ndarray | None:
        """float64 [len(auto), len(candidates)]: each request's expected tokens per round, reused
        while no forecast changed (most plain steps)."""
        cap = self.forecast.max_depth + 2
        key = (tuple(candidates), self.forecast.version,
               tuple((id(r.forecast), r.forecast.version, min(r.remaining_tokens(), cap)) for r in auto))
        if self._expected[0] != key:
            expected = self.forecast.expected_tokens([r.forecast for r in auto], candidates,
                                                     [r.remaining_tokens() for r in auto])
            self._expected = (key, expected)
        return self._expected[1]

    def _measured_bucket(self, bucket: int) -> int:
        """`bucket`, or the nearest measured one (the next larger first)."""
        measured = self.costs.buckets()
        return bucket if bucket in measured else min((b for b in measured if b > bucket), default=max(measured))

    def _row(self, bucket: int, floor: int) -> tuple[list[int], np.ndarray | None]:
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
                    seconds = np.array([self.costs.cost(use, s) for s in candidates])
                except KeyError:
                    pass
            self._rows[key] = (candidates, seconds)
        return self._rows[key]
