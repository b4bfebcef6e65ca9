"""What one engine step costs, per batch bucket and tree size, on the device the engine runs on.

A `RoundCosts` table holds measured seconds (engine/profiling.py measures them; `ddtree profile`
writes them as JSON) for each (bucket, size): size 0 is a plain decode step, size n a round that
verifies n tree nodes per request. The table belongs to one model pair on one device: it records
what it was measured for (`pair_signature`) and refuses to be used for anything else.
"""

from __future__ import annotations

import json
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import torch

FORMAT = "ddtree.round_costs/1"


def pair_signature(target, drafter, device: torch.device, cuda_graphs: bool, page_size: int = 64,
                   overlap: bool = True) -> dict:
    """What a cost table depends on: the two models' shapes, their dtype, the device (on the CPU,
    with torch's thread count: a server leaves a core to its HTTP side), graphs on or off, the
    cache's page size, whether steps overlap the host's work with the device's, and how many ranks
    the target is split over."""
    cfg = target.cfg
    device = torch.device(device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    signature = {
        "device": name,
        "dtype": str(target.embed_tokens.weight.dtype).removeprefix("torch."),
        "cuda_graphs": bool(cuda_graphs),
        "page_size": page_size,
        "overlap": bool(overlap),
        "ranks": target.shard.world,  # a tensor-parallel round costs what its collectives add
        "target": {key: getattr(cfg, key) for key in ("hidden_size", "num_hidden_layers", "vocab_size",
                                                      "n_routed_experts", "num_experts_per_tok", "kv_lora_rank")},
    }
    if device.type == "cpu":
        signature["cpu_threads"] = torch.get_num_threads()
    if drafter is not None:
        d = drafter.cfg
        signature["drafter"] = {"hidden_size": d.hidden_size, "num_hidden_layers": d.num_hidden_layers,
                                "block_size": d.block_size}
    return signature


@dataclass
class RoundCosts:
    """seconds[bucket][size]: the median wall time of one engine step with `bucket` requests all
    running rounds of `size` tree nodes (0: a plain decode step); tokens[bucket][size]: the tokens
    those steps committed, on average (a record of how the table was measured; the sizer does not
    read it). signature: pair_signature of the engine it was measured on;
    details: how it was measured (prefix length, repeats, date)."""

    signature: dict
    seconds: dict[int, dict[int, float]] = field(default_factory=dict)
    details: dict = field(default_factory=dict)
    tokens: dict[int, dict[int, float]] = field(default_factory=dict)

    def buckets(self) -> list[int]:
        return sorted(self.seconds)

    def has(self, bucket: int, sizes) -> bool:
        """Whether every size in `sizes` was measured at `bucket`."""
        row = self.seconds.get(bucket, {})
        return all(s in row for s in sizes)

    def cost(self, bucket: int, size: int) -> float:
        """Seconds of a step at (bucket, size): measured, or linear between the two nearest measured
        sizes of that bucket. A size outside the measured range is refused, never extrapolated."""
        row = self.seconds.get(bucket)
        if not row:
            raise KeyError(f"no costs measured at batch bucket {bucket} (measured: {self.buckets()})")
        if size in row:
            return row[size]
        below = [s for s in row if s < size]
        above = [s for s in row if s > size]
        if not below or not above:
            raise KeyError(f"tree size {size} is outside the sizes measured at bucket {bucket}: {sorted(row)}")
        lo, hi = max(below), min(above)
        return row[lo] + (row[hi] - row[lo]) * (size - lo) / (hi - lo)

    def tokens_per_step(self, bucket: int, size: int) -> float:
        """Tokens the measured steps at (bucket, size) committed (nearest measured size; 0 if unknown)."""
        row = self.tokens.get(bucket)
        if not row:
            return 0.0
        return row[min(row, key=lambda s: abs(s - size))]

    def merge(self, other: "RoundCosts") -> None:
        """Take `other`'s measurements (same signature), replacing ours where both have one."""
        check_signature(other.signature, self.signature, "merged table")
        for bucket, row in other.seconds.items():
            self.seconds.setdefault(bucket, {}).update(row)
        for bucket, row in other.tokens.items():
            self.tokens.setdefault(bucket, {}).update(row)
        self.details.update(other.details)

    def to_json(self) -> dict:
        def rows(table):
            return {str(b): {str(s): v for s, v in sorted(row.items())} for b, row in sorted(table.items())}

        return {"format": FORMAT, "signature": self.signature, "details": self.details, "seconds": rows(self.seconds),
                "tokens": rows(self.tokens)}

    @classmethod
    def from_json(cls, data: dict, source: str = "the table") -> "RoundCosts":
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise ValueError(f"{source} is not a ddtree round-cost table (format {FORMAT!r}; `ddtree profile` writes one)")
        try:
            seconds = {int(b): {int(s): float(t) for s, t in row.items()} for b, row in data["seconds"].items()}
            tokens = {int(b): {int(s): float(t) for s, t in row.items()} for b, row in data.get("tokens", {}).items()}
        except (KeyError, AttributeError, TypeError, ValueError) as err:
            raise ValueError(f"{source}: malformed 'seconds' ({err})") from None
        for bucket, row in seconds.items():
            bad = {s: t for s, t in row.items() if s < 0 or not t > 0}
            if bucket < 1 or bad:
                raise ValueError(f"{source}: bucket {bucket} has invalid entries {bad or row}")
        return cls(dict(data.get("signature", {})), seconds, dict(data.get("details", {})), tokens)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=1) + "\n")

    @classmethod
    def load(cls, path: str | Path, signature: dict | None = None) -> "RoundCosts":
        """Read a table written by save(); with `signature`, refuse one measured for another
        model pair, dtype or device."""
        path = Path(path)
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as err:
            raise ValueError(f"{path} is not valid JSON: {err}") from None
        table = cls.from_json(data, str(path))
        if signature is not None:
            check_signature(table.signature, signature, str(path))
        return table


def check_signature(got: dict, want: dict, source: str) -> None:
    """Refuse a table measured for something other than `want`, naming the first difference."""
    for key in sorted(set(got) | set(want)):
        if got.get(key) != want.get(key):
            raise ValueError(f"{source} was measured for {key} = {got.get(key)!r}, but this engine has "
                             f"{want.get(key)!r}: measure it again (`ddtree profile`)")


class StepCorrection:
    """What real steps cost over the table's prediction, learned from the engine's own steps.

    The table is measured on stand-ins, and a real step can cost more: on a MoE target a real
    tree's rows touch more distinct experts than stand-ins' trees do, and the host's work grows
    with the text. Each observed step gives a ratio, observed seconds over predicted, kept per
    (bucket, size) and, for tree rounds, per bucket over all tree sizes: a tree size not observed
    yet takes the ratio of the trees seen. A plain step not observed yet keeps the table's cost:
    the table measured it as it runs (no tree to differ), and a tree observed dear must not make
    plain steps look dear too, or they would never be tried. Each is the median of its last
    `memory` observations, so that a stall (a page fault, a collection, a kernel compiled late)
    moves none while it is one step in a few; one step's ratio is also clamped to `limits`. An
    observation expires `horizon` observed steps (of any shape) later: a size the sizer stopped
    taking because it once measured dear falls back to the table and is tried again, rather than
    held off by old readings that only rare re-tests could replace."""

    ANY_TREE = -1

    def __init__(self, memory: int = 16, min_count: int = 2, limits: tuple[float, float] = (0.5, 4.0),
                 horizon: int = 256):
        if memory < 1 or min_count < 1 or horizon < 1:
            raise ValueError(f"need memory, min_count and horizon >= 1, got {memory}, {min_count}, {horizon}")
        self.memory, self.min_count, self.limits, self.horizon = memory, min_count, limits, horizon
        # (bucket, size) -> (the median of its unexpired readings at its last one, steps ever seen): a
        # report; ratio() is what the sizer uses (it drops readings that expired since)
        self.ratios: dict[tuple[int, int], tuple[float, int]] = {}
        self._recent: dict[tuple[int, int], deque[tuple[int, float]]] = {}  # key -> (step number, ratio)
        # key -> (unexpired readings, their median, the step count at which the oldest expires):
        # a plain run reads its ratio three times a step, sorting only when a reading comes or goes
        self._summaries: dict[tuple[int, int], tuple[int, float | None, float]] = {}
        self._steps = 0  # steps observed, of any shape

    def observe(self, bucket: int, size: int, seconds: float, predicted: float) -> None:
        ratio = min(max(seconds / predicted, self.limits[0]), self.limits[1])
        self._steps += 1
        for key in self._keys(bucket, size):
            self._recent.setdefault(key, deque(maxlen=self.memory)).append((self._steps, ratio))
            self._summaries.pop(key, None)
            self.ratios[key] = (self._median(key, 1), self.ratios.get(key, (1.0, 0))[1] + 1)

    def ratio(self, bucket: int, size: int) -> float:
        """The factor for a step of `size` at `bucket`: its own while min_count of its
        observations are unexpired, else (trees) the bucket's over all tree sizes, else 1."""
        for key in self._keys(bucket, size):
            median = self._median(key, self.min_count)
            if median is not None:
                return median
        return 1.0

    def _median(self, key: tuple[int, int], least: int) -> float | None:
        """The median of `key`'s unexpired observations; None for fewer than `least`."""
        summary = self._summaries.get(key)
        if summary is None or self._steps >= summary[2]:
            summary = self._summaries[key] = self._summarize(key)
        return summary[1] if summary[0] >= least else None

    def _summarize(self, key: tuple[int, int]) -> tuple[int, float | None, float]:
        unexpired = [(step, r) for step, r in self._recent.get(key, ()) if step > self._steps - self.horizon]
        if not unexpired:
            return 0, None, float("inf")
        ordered = sorted(r for _, r in unexpired)
        half = len(ordered) // 2
        median = ordered[half] if len(ordered) % 2 else (ordered[half - 1] + ordered[half]) / 2
        return len(ordered), median, unexpired[0][0] + self.horizon

    def seen(self, bucket: int, size: int) -> bool:
        """Whether min_count steps of exactly `size` at `bucket` were observed, unexpired."""
        return self._median((bucket, size), self.min_count) is not None

    def _keys(self, bucket: int, size: int) -> list[tuple[int, int]]:
        return [(bucket, size)] + ([(bucket, self.ANY_TREE)] if size > 0 else [])
