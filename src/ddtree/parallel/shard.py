"""Which part of the model a process holds, and the collectives that join the parts.

One process per GPU (gloo on the CPU), each holding a `Shard` of the target, as the serving engines
split DeepSeek-V3-family models: MLA's heads split across ranks (q / kv_b projections by head,
o_proj by its input rows; the latent cache whole on every rank), the routed experts split across
ranks (expert parallel: each rank holds E / N of them and adds their share of every row), the shared
experts and the dense MLP split by their intermediate width, the embedding and lm_head split by
vocabulary. Each layer's partial outputs are summed by one all-reduce; the logits are gathered.
The drafter is replicated. `SINGLE` (world 1) makes every collective a no-op, so one process runs
the same code.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Shard:
    """rank of world processes; group: their torch.distributed process group (None: world 1)."""

    rank: int = 0
    world: int = 1
    group: object = None

    def __post_init__(self):
        if not 0 <= self.rank < self.world:
            raise ValueError(f"rank {self.rank} is not in a world of {self.world}")
        if self.world > 1 and self.group is None:
            raise ValueError("a shard of a world of several processes needs their process group")

    def part(self, total: int, what: str) -> slice:
        """This rank's contiguous share of `total` items (heads, experts, columns, vocabulary rows)."""
        if total % self.world:
            raise ValueError(f"{what} ({total}) does not divide among {self.world} ranks")
        size = total // self.world
        return slice(self.rank * size, (self.rank + 1) * size)

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """The sum over ranks of `t` (in place); `t` itself in one process."""
        if self.world > 1:
            dist.all_reduce(t, group=self.group)
        return t

    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        """Every rank's `t` concatenated along the last dimension, rank order; `t` in one process."""
        if self.world == 1:
            return t
        parts = [torch.empty_like(t) for _ in range(self.world)]
        dist.all_gather(parts, t.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)

    def agree(self, value: int) -> int:
        """The least of every rank's `value` (what all of them can do, e.g. KV pages that fit)."""
        if self.world == 1:
            return value
        device = "cuda" if dist.get_backend(self.group) == "nccl" else "cpu"
        t = torch.tensor([value], dtype=torch.int64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return int(t.item())


SINGLE = Shard()
