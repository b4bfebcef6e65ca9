"""Run a function on several gloo ranks, each in a process of its own (torch.multiprocessing)."""

from __future__ import annotations

import socket
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ddtree.parallel.shard import Shard


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world: int, port: int, fn, args) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    try:
        torch.set_num_threads(1)
        fn(Shard(rank, world, dist.group.WORLD), *args)
    finally:
        dist.destroy_process_group()


def run_ranks(world: int, fn, *args) -> None:
    """fn(shard, *args) on `world` gloo ranks (fn and args picklable: module-level functions);
    raises if any rank fails."""
    mp.spawn(_entry, args=(world, free_port(), fn, args), nprocs=world, join=True)
