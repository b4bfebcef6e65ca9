"""Expected tokens a round commits, per request and tree size, from the drafter's own probabilities.

A tree's expected accepted nodes are the sum over its nodes of the probability that the target's
path runs through each: with a calibrated drafter that is the node's path probability (the
best-first heap's weight), and the first n nodes in pop order are the tree of size n. The drafter
is not calibrated, so the host learns one map from path probability to acceptance rate, per bin
of log2(p), pooled over all requests' verified nodes (a reliability diagram), starting from the
prior that the drafter is right; a per-request scale then follows what each request actually
gets. All of it is host arithmetic on the small int64 result every round already copies back.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# A round's result carries node path log-probs as fixed-point int64 (round(logp * PATH_SCALE)),
# NO_NODE past the tree's last node.
PATH_SCALE = 1 << 20
NO_NODE = -(1 << 62)
_LOG2_FIXED = round(PATH_SCALE * 0.6931471805599453)  # ln 2 in PATH_SCALE units: one bin of log2 p


class Calibration:
    """P(the target accepts a node | the drafter gave its path probability p), per bin of log2 p.

    Bin j holds p in (2^-(j+1), 2^-j]; the last bin holds everything smaller. Counts decay by
    `decay` per observed tree so the map follows drift; each bin starts from `prior_weight`
    pseudo-observations at its own probability (the drafter trusted until shown otherwise)."""

    BINS = 16

    def __init__(self, prior_weight: float = 4.0, decay: float = 0.999):
        self.prior_weight, self.decay = prior_weight, decay
        self.prior = 2.0 ** -(np.arange(self.BINS) + 0.5)
        self.verified = np.zeros(self.BINS)
        self.accepted = np.zeros(self.BINS)

    def bins(self, path_fixed: np.ndarray) -> np.ndarray:
        """Bin index per fixed-point path log-prob (PATH_SCALE; NO_NODE goes to the last bin)."""
        return np.minimum(np.maximum(-np.asarray(path_fixed, dtype=np.int64), 0) // _LOG2_FIXED, self.BINS - 1)

    def rates(self) -> np.ndarray:
        """float64 [BINS]: the acceptance rate of a node in each bin."""
        w = self.prior_weight
        return (self.accepted + w * self.prior) / (self.verified + w)

    def observe(self, bins: np.ndarray, accepted: np.ndarray, trees: int = 1) -> None:
        """Verified nodes of `trees` trees: their bins and whether each was accepted (bool, same length)."""
        self.verified *= self.decay**trees
        self.accepted *= self.decay**trees
        self.verified += np.bincount(bins, minlength=self.BINS)
        self.accepted += np.bincount(bins[accepted], minlength=self.BINS)


@dataclass
class RequestForecast:
    """One request's view: curve[n] = calibrated expected accepted nodes of its tree of n nodes
    (an average over its recent rounds; None before its first tree round is read); observed /
    predicted: decayed sums of accepted nodes and of their calibrated expectation (the
    per-request scale); decode_seconds: cost of the plain steps it took since its last tree;
    wait: how many probe costs of plain steps it waits before the next probe (engine/sizing.py;
    0: not set yet)."""

    curve: np.ndarray | None = None
    observed: float = 0.0
    predicted: float = 0.0
    decode_seconds: float = 0.0
    wait: float = 0.0
    version: int = 0  # bumped whenever curve or scale change


class AcceptanceForecast:
    """Learns from every read tree round; answers expected tokens per round for any tree size."""

    def __init__(self, info_nodes: int, max_depth: int, *, smoothing: float = 0.5, scale_decay: float = 0.8,
                 scale_shrink: float = 1.0):
        """info_nodes: nodes whose path probabilities a round reports (the largest size the engine
        may choose); smoothing: weight of the old curve when a new round is read; scale_decay /
        scale_shrink: memory and pseudo-count of the per-request scale."""
        self.info_nodes, self.max_depth = info_nodes, max_depth
        self.smoothing, self.scale_decay, self.scale_shrink = smoothing, scale_decay, scale_shrink
        self.calibration = Calibration()
        # the prior of a request with no tree read yet: the recent trees' path log-probs, read
        # through the calibration as it is now (not as it was when they were read)
        self._recent = np.full((self.RECENT_TREES, info_nodes), NO_NODE, dtype=np.int64)
        self._recent_count = 0
        self._pooled: tuple = (-1, None)  # (version computed at, curve)
        self.version = 0  # bumped by every observe (the pooled curve changes)

    RECENT_TREES = 64

    @property
    def pooled_curve(self) -> np.ndarray | None:
        """float64 [info_nodes + 1]: a typical recent tree's calibrated expected accepted nodes at
        each size (None before any tree was read)."""
        if not self._recent_count:
            return None
        if self._pooled[0] != self.version:
            rows = self._recent[: min(self._recent_count, self.RECENT_TREES)]
            self._pooled = (self.version, self.calibrated_curves(rows).mean(0))
        return self._pooled[1]

    def calibrated_curves(self, path_fixed: np.ndarray, bins: np.ndarray | None = None) -> np.ndarray:
        """float64 [R, n + 1]: calibrated expected accepted nodes of the first 0 .. n nodes (bins:
        calibration.bins(path_fixed), when already at hand)."""
        bins = self.calibration.bins(path_fixed) if bins is None else bins
        rates = np.where(path_fixed != NO_NODE, self.calibration.rates()[bins], 0.0)
        return np.concatenate([np.zeros((len(path_fixed), 1)), np.cumsum(rates, axis=1)], axis=1)

    def observe(self, forecasts: list[RequestForecast], path_fixed: np.ndarray, verified: int, accepted: np.ndarray,
                accept_len: np.ndarray) -> None:
        """One tree round of R requests, read back: path_fixed int64 [R, info_nodes] (fixed-point path
        log-probs in pop order, NO_NODE past the tree), verified (nodes the round verified), accepted
        int64 [R, D + 1] (accepted node indices, root first, -1 after), accept_len int64 [R] (>= 1)."""
        path_fixed, accepted, accept_len = (np.asarray(a, dtype=np.int64) for a in (path_fixed, accepted, accept_len))
        r, n = path_fixed.shape
        bins = self.calibration.bins(path_fixed)
        present = path_fixed != NO_NODE
        curves = self.calibrated_curves(path_fixed, bins)  # [R, n + 1]
        in_tree = np.minimum(verified, present.sum(1))  # [R]
        nodes = accepted[:, 1:]  # [R, D]: accepted tree nodes, 1-based
        took = (np.arange(1, nodes.shape[1] + 1)[None, :] < accept_len[:, None]) & (nodes >= 1) & (nodes <= in_tree[:, None])
        was_accepted = np.zeros((r, n), dtype=bool)
        rows, cols = np.nonzero(took)
        was_accepted[rows, nodes[rows, cols] - 1] = True
        observed, predicted = took.sum(1), curves[np.arange(r), in_tree]
        d, s = self.scale_decay, self.smoothing
        for i, forecast in enumerate(forecasts):
            forecast.observed = d * forecast.observed + observed[i]
            forecast.predicted = d * forecast.predicted + predicted[i]
            forecast.curve = curves[i] if forecast.curve is None else s * forecast.curve + (1 - s) * curves[i]
            forecast.decode_seconds = 0.0
            forecast.version += 1
        self.version += 1
        rows = path_fixed[-self.RECENT_TREES :]
        self._recent[(self._recent_count + r - len(rows) + np.arange(len(rows))) % self.RECENT_TREES] = rows
        self._recent_count += r
        verified_nodes = np.arange(n)[None, :] < in_tree[:, None]
        self.calibration.observe(bins[verified_nodes], was_accepted[verified_nodes], trees=r)

    def expected_tokens(self, forecasts: list[RequestForecast], sizes: list[int], remaining: np.ndarray) -> np.ndarray | None:
        """float64 [R, len(sizes)]: tokens a round of each tree size is expected to commit for each
        request (1 + expected accepted nodes; size 0 is a plain step: 1), at most `remaining` [R]
        (what each may still take). None when nothing is known of some request (no tree read at all)."""
        pooled = self.pooled_curve if any(f.curve is None for f in forecasts) else None  # only when needed
        if pooled is None and any(f.curve is None for f in forecasts):
            return None
        curves = np.stack([pooled if f.curve is None else f.curve for f in forecasts])  # [R, n + 1]
        k = self.scale_shrink
        scale = np.array([(f.observed + k) / (f.predicted + k) for f in forecasts])
        nodes = curves[:, np.minimum(np.asarray(sizes), curves.shape[1] - 1)] * scale[:, None]
        tokens = 1.0 + np.minimum(nodes, self.max_depth)
        return np.minimum(tokens, np.maximum(1, np.asarray(remaining))[:, None])
