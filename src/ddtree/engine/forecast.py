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

    def bins(self, logprobs: np.ndarray) -> np.ndarray:
        """Bin index per path log-prob (natural log; -inf goes to the last bin)."""
        with np.errstate(invalid="ignore", divide="ignore"):
            j = np.floor(-np.asarray(logprobs, dtype=np.float64) / np.log(2.0))
        return np.clip(np.nan_to_num(j, nan=self.BINS - 1, posinf=self.BINS - 1), 0, self.BINS - 1).astype(np.int64)

    def rates(self) -> np.ndarray:
        """float64 [BINS]: the acceptance rate of a node in each bin."""
        w = self.prior_weight
        return (self.accepted + w * self.prior) / (self.verified + w)

    def observe(self, bins: np.ndarray, accepted: np.ndarray) -> None:
        """One verified tree: its nodes' bins and whether each was accepted (bool, same length)."""
        self.verified *= self.decay
        self.accepted *= self.decay
        np.add.at(self.verified, bins, 1.0)
        np.add.at(self.accepted, bins[accepted], 1.0)


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
        self.pooled_curve: np.ndarray | None = None  # the prior of a request with no tree read yet

    def observe(self, forecast: RequestForecast, path_fixed: list[int], verified: int, accepted: list[int]) -> None:
        """A tree round of one request, read back: path_fixed (info_nodes fixed-point path log-probs
        in pop order), verified (nodes the round verified), accepted (accepted node indices, 1-based
        pop order, root excluded)."""
        fixed = np.asarray(path_fixed, dtype=np.int64)
        logp = np.where(fixed == NO_NODE, -np.inf, fixed / PATH_SCALE)
        bins = self.calibration.bins(logp)
        present = np.isfinite(logp)
        rates = np.where(present, self.calibration.rates()[bins], 0.0)
        curve = np.concatenate([[0.0], np.cumsum(rates)])  # [info_nodes + 1]
        verified = min(verified, int(present.sum()))
        was_accepted = np.zeros(verified, dtype=bool)
        nodes = [a - 1 for a in accepted if 1 <= a <= verified]
        was_accepted[nodes] = True
        d = self.scale_decay
        forecast.observed = d * forecast.observed + len(nodes)
        forecast.predicted = d * forecast.predicted + curve[verified]
        s = self.smoothing
        forecast.curve = curve if forecast.curve is None else s * forecast.curve + (1 - s) * curve
        self.pooled_curve = curve if self.pooled_curve is None else 0.9 * self.pooled_curve + 0.1 * curve
        forecast.decode_seconds = 0.0
        self.calibration.observe(bins[:verified], was_accepted)

    def expected_tokens(self, forecast: RequestForecast, sizes: list[int], remaining: int) -> np.ndarray | None:
        """float64 [len(sizes)]: tokens a round of each tree size is expected to commit for this
        request (1 + expected accepted nodes; size 0 is a plain step: 1), at most `remaining`
        (what the request may still take). None when nothing is known yet (no tree read at all)."""
        curve = forecast.curve if forecast.curve is not None else self.pooled_curve
        if curve is None:
            return None
        k = self.scale_shrink
        scale = (forecast.observed + k) / (forecast.predicted + k)
        nodes = curve[np.minimum(np.asarray(sizes), len(curve) - 1)] * scale
        tokens = 1.0 + np.minimum(nodes, self.max_depth)
        return np.minimum(tokens, max(1, remaining))
