"""Rank 0's device calls, sent to the other ranks: one round is one SPMD step.

Rank 0 runs the whole engine (scheduler, sizer, requests); every other rank holds its shard of the
models and an engine of the same shape that only follows: its Worker runs each call rank 0's
Worker sends (occupy, vacate, prefill, round; engine/worker.py), in order, with the same plain
values, so every rank's batch state, caches and captured graphs stay the same and every collective
inside the models meets its peers. Calls travel pickled over a gloo group (on GPUs, beside the
NCCL group the models' collectives use). A rank that dies or stops answering makes the next call
or collective fail within the group's timeout, with the error it raised: nothing waits forever.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch.distributed as dist

STOP = "stop"


class RankLost(RuntimeError):
    """A tensor-parallel rank died or stopped answering, or a relayed call failed on rank 0: the
    ranks are out of step and the engine cannot go on (a server ends)."""


class Relay:
    """Rank 0's sending side; group: the gloo process group of all ranks."""

    def __init__(self, group):
        self.group = group
        self.closed = False

    def send(self, op: str, *args) -> None:
        if self.closed:
            raise RuntimeError(f"the other ranks were released: no {op} can reach them")
        try:
            dist.broadcast_object_list([(op, args)], src=0, group=self.group)
        except (RuntimeError, dist.DistError) as err:
            raise RankLost(f"a tensor-parallel rank is gone (its process died or stopped answering), so this "
                           f"engine cannot continue: {err}") from err

    @contextlib.contextmanager
    def call(self, op: str, *args) -> Iterator[None]:
        """Send `op` to the other ranks, then run rank 0's own part in the body: any error there
        (a collective timed out on a silent rank, say) leaves the ranks out of step, so it is
        RankLost too."""
        self.send(op, *args)
        try:
            yield
        except RankLost:
            raise
        except Exception as err:
            raise RankLost(f"a tensor-parallel {op} failed on rank 0, so the ranks are out of step and this engine "
                           f"cannot continue: {err}") from err

    def close(self) -> None:
        """Release the other ranks (their follow loops return)."""
        if not self.closed:
            self.send(STOP)
            self.closed = True


def follow(worker, group) -> None:
    """A follower rank's loop: run every call rank 0 sends on `worker`, until it sends STOP."""
    while True:
        box = [None]
        dist.broadcast_object_list(box, src=0, group=group)
        op, args = box[0]
        if op == STOP:
            return
        getattr(worker, op)(*args)
