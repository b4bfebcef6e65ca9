"""A round in flight: launched on the device, its result copied back without waiting.

The engine launches round k, then reads round k - 1's result (whose copy finished while round k
was being queued or run), so the host's work on committed tokens (detokenizing, stop strings,
streaming) overlaps the device's next round instead of stalling it. Nothing a round needs comes
from the previous round's host work: the batch state lives on the device, pages are reserved for
the most the round in flight can commit, and a slot whose request is out of tokens takes no part
(BatchState.remaining), so a request the host has not yet seen finish cannot outgrow its pages.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .request import Request
from .round import RoundPlan
from .timing import StageTimer


@dataclass
class Flight:
    """requests: the round's requests (each in its slot at launch); result: int64 [bucket, width]
    on the host (page-locked on CUDA), complete once `done` has; timer: the round's stage marks;
    irregular: set by the engine when the launch ran the round eagerly or captured its graph."""

    requests: list[Request]
    plan: RoundPlan
    result: torch.Tensor
    done: torch.cuda.Event | None
    timer: StageTimer
    irregular: bool = False  # ran eagerly or captured its graph: its time is no step's cost

    def rows(self) -> list[list[int]]:
        """The result as lists, waiting for the copy (and so the round) to finish."""
        return self.array().tolist()

    def array(self):
        """The result as a NumPy array (int64 [bucket, width], no copy), waiting as rows() does."""
        if self.done is not None:
            self.done.synchronize()
        return self.result.numpy()


@dataclass
class Admission:
    """Prompts prefilled: their requests and first tokens (int64 [len(requests)] on the host, as
    Flight's result), read after the next round is launched, so the device runs that round while
    the host waits for the prefill."""

    requests: list[Request]
    first: torch.Tensor
    done: torch.cuda.Event | None
    timer: StageTimer

    def tokens(self) -> list[int]:
        if self.done is not None:
            self.done.synchronize()
        return self.first.tolist()


def launch_copy(result: torch.Tensor, requests: list[Request], plan: RoundPlan, timer: StageTimer) -> Flight:
    """Queue the copy of a round's device result to the host, behind the round; returns at once."""
    return Flight(requests, plan, *copy_to_host(result), timer)


def copy_to_host(values: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
    """(a host copy of `values`, the event after which it is complete; None off CUDA, where the
    copy is `values` itself), queued behind the work already on the device; returns at once."""
    if not values.is_cuda:
        return values, None
    host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
    host.copy_(values, non_blocking=True)
    done = torch.cuda.Event()
    done.record(torch.cuda.current_stream(values.device))  # the engine's device, whatever the thread's current one
    return host, done
