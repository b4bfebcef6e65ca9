"""What a round of each tree size commits, measured in hindsight from the rounds the engine ran.

A best-first tree of n nodes is exactly the first n nodes (in pop order) of any larger one, and a
node's ancestors come before it, so a round that verified V nodes also says what a round of any
n <= V nodes would have committed: the accept walk there follows the same path and stops at its
first node numbered above n. So tokens(n) = 1 + the accepted nodes numbered <= n, exactly, for
every n <= V and at any temperature (the target's choice at a node depends only on the node's
ancestors and position).

The ledger keeps, for each node number, how often it lay on the accepted path (an average over
the recent rounds that verified it). Expected tokens at size n are 1 plus the sum of the first n
rates. Nothing is predicted from the drafter's probabilities: on the demo pair those correlated
0.28 with what a round then committed (docs/notes/auto_budget.md).
"""

from __future__ import annotations

import functools
from statistics import NormalDist

import numpy as np

PROBE_MARGIN = 0.05  # a closed batch probes trees only while they are expected to end it at most 5% after plain steps
PRIOR_NODES = 24.0  # a request's acceptance relative to the pooled rates starts as if it had matched them for 24 nodes


class AcceptanceLedger:
    """Per node number 1 .. largest: the rate at which it was on a round's accepted path."""

    def __init__(self, largest: int, memory: float = 64.0):
        """largest: the most nodes a round may verify; memory: rounds over which a node's rate is
        averaged (older rounds fade exponentially)."""
        if largest < 1 or memory < 1:
            raise ValueError(f"need largest >= 1 and memory >= 1, got {largest}, {memory}")
        self.largest, self.decay = largest, 1.0 - 1.0 / memory
        self.hits = np.zeros(largest + 1)  # [n]: decayed count of rounds whose path held node n
        self.seen = np.zeros(largest + 1)  # [n]: decayed count of request-rounds that verified node n
        self.squares = np.zeros(largest + 1)  # [n]: decayed sum of (tokens a round of n nodes committed)^2
        self.frontier = 0  # the most nodes any observed round verified: sizes up to it are known
        self._cumulative: np.ndarray | None = None

    def observe(self, accepted: np.ndarray, accept_len: np.ndarray, verified: int) -> None:
        """One tree round of R requests read back: accepted int64 [R, D + 1] (the accepted node
        numbers, root (0) first, -1 after), accept_len int64 [R] (tokens committed, >= 1),
        verified: tree nodes each request verified."""
        accepted, accept_len = np.asarray(accepted, dtype=np.int64), np.asarray(accept_len, dtype=np.int64)
        v = min(int(verified), self.largest)
        if v < 1 or len(accepted) == 0:
            return
        nodes = accepted[:, 1:]
        on_path = (np.arange(1, nodes.shape[1] + 1)[None, :] < accept_len[:, None]) & (nodes >= 1) & (nodes <= v)
        self.hits[1 : v + 1] *= self.decay
        self.seen[1 : v + 1] *= self.decay
        self.seen[1 : v + 1] += len(accepted)
        flat = np.nonzero(on_path)[0] * (v + 1) + nodes[on_path]  # (request, node) of each accepted node
        counts = np.bincount(flat, minlength=len(accepted) * (v + 1)).reshape(len(accepted), v + 1)
        self.hits[1 : v + 1] += counts[:, 1:].sum(0)
        tokens = 1.0 + np.cumsum(counts[:, 1:], 1)  # [R, v]: what a round of 1 .. v nodes would have committed
        self.squares[1 : v + 1] = self.squares[1 : v + 1] * self.decay + (tokens * tokens).sum(0)
        self.frontier = max(self.frontier, v)
        self._cumulative = None

    def tokens(self, size: int) -> float:
        """Expected tokens a round of `size` nodes commits per request (size 0: a plain step, 1);
        KeyError for a size past the frontier (never verified)."""
        return float(self.tokens_of([size])[0])

    def tokens_of(self, sizes: list[int]) -> np.ndarray:
        """float64 [len(sizes)]: tokens(s) for each of `sizes` at once (the sizer's every round)."""
        if max(sizes, default=0) > self.frontier:
            raise KeyError(f"no round has verified {max(sizes)} nodes yet (frontier {self.frontier})")
        if self._cumulative is None:
            rates = np.divide(self.hits, self.seen, out=np.zeros_like(self.hits), where=self.seen > 0)
            self._cumulative = 1.0 + np.cumsum(rates)  # index n: 1 + rates of nodes 1 .. n (rates[0] = 0)
        return self._cumulative[sizes]

    def variance_of(self, sizes: list[int]) -> np.ndarray:
        """float64 [len(sizes)]: the variance of the tokens one request's round of each size commits
        (0 for a plain step), over the same recent rounds as tokens_of."""
        sizes = np.asarray(sizes, dtype=np.int64)
        mean = self.tokens_of(sizes)
        squares = np.divide(self.squares[sizes], self.seen[sizes], out=mean * mean, where=self.seen[sizes] > 0)
        return np.maximum(squares - mean * mean, 0.0)

    def weight(self, size: int) -> float:
        """How many recent request-rounds (decayed) verified node `size`: how sure tokens(size) is."""
        return float(self.seen[min(size, self.largest)]) if size > 0 else float("inf")


@functools.cache
def largest_normal(count: int) -> float:
    """The expected largest of `count` standard normal draws (Blom's approximation; 0 for one)."""
    return NormalDist().inv_cdf((count - 0.375) / (count + 0.25)) if count > 1 else 0.0


def slowest_rounds(ledger: AcceptanceLedger, sizes: list[int], scale: np.ndarray, caps: np.ndarray) -> np.ndarray:
    """float64 [len(sizes)]: the rounds a batch's slowest request is expected to take at each size,
    for R requests with `caps` [R] tokens left whose accepted nodes per round are the ledger's
    times `scale` [R]. A request's rounds spread with the rounds' luck (a renewal count: the
    variance of tokens per round over the mean cubed, per token), and a batch ends with its
    unluckiest request, about largest_normal(R) standard deviations past its mean: at one
    request trees win by their rate, at 32 only by a margin that covers the spread."""
    per_round = np.maximum(np.minimum(1.0 + scale[:, None] * (ledger.tokens_of(sizes) - 1.0)[None, :], caps[:, None]), 1.0)
    spread = np.sqrt(caps[:, None] * ledger.variance_of(sizes)[None, :] / per_round**3)  # [R, S] rounds
    return np.ceil(caps[:, None] / per_round + largest_normal(len(caps)) * spread).max(0)


def soonest_done(ledger: AcceptanceLedger, known: list[int], seconds: list[float], auto: list,
                 caps: np.ndarray) -> tuple[int, bool]:
    """For a closed batch of `auto` requests (engine Requests, `caps` [R] tokens left): the size
    of `known` (0 included; `seconds` a step of each) whose slowest request is expected to end
    first (slowest_rounds; a request's nodes per round are the pooled rate's times its own scale,
    its accepted nodes over what the pooled rates expected of the same rounds, PRIOR_NODES
    pulling it to 1), and whether the best tree ends within PROBE_MARGIN of plain steps (a probe
    may show it pays)."""
    scale = np.array([(r.accepted_nodes + PRIOR_NODES) / (r.expected_nodes + PRIOR_NODES) for r in auto])
    ends = slowest_rounds(ledger, known, scale, caps) * np.asarray(seconds)
    trees = [i for i, s in enumerate(known) if s > 0]
    close = 0 not in known or not trees or ends[trees].min() <= (1 + PROBE_MARGIN) * ends[known.index(0)]
    return known[int(np.argmin(ends))], close  # ties to the smaller size
