"""Per-stage timing of a round without host synchronization inside it.

On CUDA each stage boundary records an event; the durations are read after the round's one
device-to-host copy has synchronized anyway. On the CPU the work is synchronous, so wall-clock
marks are the stage times.
"""

from __future__ import annotations

import time

import torch

STAGES = ("prefill", "draft", "topk", "build", "verify", "accept", "commit", "round")  # round: a graph replay


class StageTimer:
    """mark(stage) closes the stage that ran since the previous mark (or since start())."""

    def __init__(self, device: torch.device, enabled: bool = True):
        self.cuda = device.type == "cuda"
        self.enabled = enabled
        self._marks: list[tuple[str, object]] = []

    def _now(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def start(self) -> None:
        self._marks = [("", self._now())] if self.enabled else []

    def mark(self, stage: str) -> None:
        if self.enabled:
            self._marks.append((stage, self._now()))

    def seconds(self) -> dict[str, float]:
        """Seconds per stage since start(); call after the work has completed (synchronized)."""
        out: dict[str, float] = {}
        if self.cuda and self._marks:
            self._marks[-1][1].synchronize()  # an event recorded after the last wait may still be queued
        for (_, before), (stage, after) in zip(self._marks, self._marks[1:]):
            spent = before.elapsed_time(after) / 1e3 if self.cuda else after - before
            out[stage] = out.get(stage, 0.0) + spent
        return out
