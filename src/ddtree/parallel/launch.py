"""Starting a tensor-parallel engine's ranks: one process per GPU (rank r on cuda:r, NCCL), or
gloo processes on the CPU. The calling process is rank 0 and keeps the whole engine; ranks
1 .. N - 1 are started here, load their shards of the models, build an engine of the same shape
and follow rank 0's device calls (parallel/relay.py) until it releases them.
"""

from __future__ import annotations

import atexit
import os
import socket
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ..engine.heap import frozen_heap
from ..engine.loading import load_pair
from .relay import Relay, follow
from .shard import Shard

TIMEOUT_S = 120.0  # a rank that stops answering fails every other rank's call after this (DDTREE_TP_TIMEOUT_S)


def rank_timeout() -> timedelta:
    """How long a collective or a relayed call waits for a silent rank: DDTREE_TP_TIMEOUT_S
    seconds (the ranks inherit the environment), else TIMEOUT_S."""
    text = os.environ.get("DDTREE_TP_TIMEOUT_S", "")
    try:
        seconds = float(text) if text else TIMEOUT_S
    except ValueError:
        seconds = -1.0
    if not seconds > 0:
        raise ValueError(f"DDTREE_TP_TIMEOUT_S must be a positive number of seconds, got {text!r}")
    return timedelta(seconds=seconds)


@dataclass
class Ranks:
    """Rank 0's handle on the others: the relay that drives them and their processes."""

    shard: Shard
    relay: Relay
    processes: object = None
    released: bool = field(default=False)

    def release(self) -> None:
        """Stop the followers and wait for them to exit (idempotent)."""
        if self.released:
            return
        self.released = True
        lost = False
        try:
            self.relay.close()
        except RuntimeError:
            lost = True  # a rank gone or hung: the others cannot be released in order
        finally:
            if self.processes is not None:
                if lost:  # a hung follower would hold the join: end them all
                    for process in self.processes.processes:
                        process.kill()
                try:
                    self.processes.join(timeout=60)
                except mp.ProcessExitedException:
                    pass  # a follower that died (or was ended here): its error was the engine's error
            if dist.is_initialized():
                dist.destroy_process_group()


def _free_address() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def _join(rank: int, world: int, address: str, backend: str) -> tuple[Shard, object]:
    """Join the process group; returns (this rank's Shard, the gloo group that carries the relay)."""
    if backend == "nccl":
        torch.cuda.set_device(rank)
    timeout = rank_timeout()
    dist.init_process_group(backend, init_method=f"tcp://{address}", rank=rank, world_size=world, timeout=timeout)
    control = dist.new_group(backend="gloo", timeout=timeout) if backend == "nccl" else dist.group.WORLD
    return Shard(rank, world, dist.group.WORLD), control


def _follower(index: int, world: int, address: str, backend: str, load: dict, engine_args: dict,
              engine_class: type) -> None:
    rank = index + 1
    shard, control = _join(rank, world, address, backend)
    try:
        device = f"cuda:{rank}" if backend == "nccl" else "cpu"
        target, drafter, tokenizer, stops = load_pair(**load, device=device, shard=shard)
        engine = engine_class(target, drafter, tokenizer, **{**engine_args, "round_costs": None})
        with frozen_heap():  # the shard's model out of the collections its rounds trigger
            follow(engine.worker, control)
    finally:
        dist.destroy_process_group()


def start_ranks(world: int, device: torch.device, load: dict, engine_args: dict, engine_class: type) -> Ranks:
    """Start ranks 1 .. world - 1 (their models from `load`, load_pair's arguments but the device;
    their engines `engine_class(target, drafter, tokenizer, **engine_args)`) and join them as rank 0.
    On CUDA: NCCL, rank r on cuda:r (there must be `world` GPUs); on the CPU: gloo."""
    if world < 2:
        raise ValueError(f"tensor_parallel must be >= 2 to start ranks, got {world}")
    if dist.is_initialized():
        raise RuntimeError("torch.distributed is already initialized in this process: one parallel engine per process")
    backend = "nccl" if device.type == "cuda" else "gloo"
    if backend == "nccl" and torch.cuda.device_count() < world:
        raise ValueError(f"tensor_parallel={world} needs {world} GPUs; this machine has {torch.cuda.device_count()}")
    address = _free_address()
    processes = mp.start_processes(_follower, args=(world, address, backend, load, engine_args, engine_class),
                                   nprocs=world - 1, join=False, start_method="spawn")
    shard, control = _join(0, world, address, backend)
    ranks = Ranks(shard, Relay(control), processes)
    atexit.register(ranks.release)  # an engine never closed still releases its ranks when the process ends
    return ranks
