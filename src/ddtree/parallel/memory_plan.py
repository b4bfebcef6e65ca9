"""How a model pair fits on N GPUs, from its config.json files alone (nothing loaded): each rank's
weights, counted on a model built on the meta device with that rank's Shard (so the count follows
the models' own split), the drafter and its context cache (whole on every rank), and the KV cache
that the rest holds, sized as the engine sizes it (engine/loading.py) from the GPU's memory less
CONTEXT_BYTES for the CUDA context and the allocator's own.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..engine.loading import KV_MEMORY_FRACTION, drafter_capacity, kv_page_bytes, pages_that_fit
from ..engine.pages import pages_for
from .shard import Shard

CONTEXT_BYTES = 1 << 30  # an assumption: what a process's CUDA context and kernels take before any tensor
PREFILL_CHUNK = 512  # the engine's default prompt rows per prefill call (its drafter context's margin)
_COUNTING = object()  # the process group of a shard built only to be counted: it runs no collective
GIB = 2**30

PARTS = ("routed experts", "attention", "dense and shared MLPs", "embedding and lm_head", "norms and routers")


def readable(size: int) -> str:
    """Bytes in GiB, or MiB below a tenth of one."""
    return f"{size / GIB:.2f} GiB" if size >= GIB // 10 else f"{size / 2**20:.1f} MiB"


def _part(name: str) -> str:
    if ".mlp.w_" in name:
        return PARTS[0]
    if ".self_attn." in name:
        return PARTS[1]
    if ".mlp." in name and not name.endswith("gate.weight") and ".gate.e_score" not in name:
        return PARTS[2]
    if name.startswith(("embed_tokens", "lm_head")):
        return PARTS[3]
    return PARTS[4]


def parameter_bytes(module: torch.nn.Module, dtype: torch.dtype, skip: tuple[str, ...] = ()) -> dict[str, int]:
    """Bytes of `module`'s parameters by PARTS, floating ones in `dtype` (as the loader stores
    them) and integer ones (packed INT4) as they are; names starting with `skip` left out."""
    size = torch.empty(0, dtype=dtype).element_size()
    out = dict.fromkeys(PARTS, 0)
    for name, p in module.named_parameters():
        if not name.startswith(skip):
            out[_part(name)] += p.numel() * (size if p.is_floating_point() else p.element_size())
    return out


@dataclass
class MemoryPlan:
    """What one rank of `world` holds; bytes throughout."""

    world: int
    gpu_bytes: int
    target: dict[str, int]  # a rank's weights by part (every rank's are equal)
    drafter: int  # the drafter's weights (without the target's embedding and lm_head, which it reads)
    drafter_cache: int  # its context cache for max_batch requests
    page_bytes: int  # one KV page over every layer
    pages: int
    page_size: int
    max_batch: int
    max_model_len: int

    @property
    def weights(self) -> int:
        return sum(self.target.values()) + self.drafter

    @property
    def tokens(self) -> int:
        return self.pages * self.page_size

    def lines(self) -> list[str]:
        ranks = f"each of {self.world} ranks" if self.world > 1 else "one GPU"
        out = [f"memory plan for {ranks} ({self.gpu_bytes / GIB:.1f} GiB, of which {CONTEXT_BYTES / GIB:.0f} GiB assumed "
               f"for the CUDA context):",
               f"  target weights {sum(self.target.values()) / GIB:.2f} GiB: "
               + ", ".join(f"{part} {b / GIB:.2f}" for part, b in self.target.items() if b)]
        if self.drafter:
            out.append(f"  drafter {self.drafter / GIB:.2f} GiB (whole on every rank), its context cache "
                       f"{self.drafter_cache / GIB:.2f} GiB for {self.max_batch} requests")
        out.append(f"  KV cache {self.pages} pages x {self.page_size} slots = {self.tokens} tokens "
                   f"({self.pages * self.page_bytes / GIB:.2f} GiB; at most {KV_MEMORY_FRACTION:.0%} of what the weights "
                   f"leave, at most what {self.max_batch} requests of {self.max_model_len} tokens use): "
                   f"{self.tokens // self.max_model_len} requests of {self.max_model_len} tokens at once")
        return out


def plan_memory(target_cfg, drafter_cfg, world: int, gpu_bytes: int, *, dtype: torch.dtype = torch.bfloat16,
                page_size: int = 64, max_model_len: int | None = None, max_batch: int = 32,
                max_budget: int = 256) -> MemoryPlan:
    """The plan for `world` ranks of `gpu_bytes` each (TargetConfig, DrafterConfig or None).
    max_model_len defaults to the engine's (the model's positions, at most 8192). Raises
    ValueError, one line, where the split does not divide (heads, experts, vocabulary) or the
    weights leave no room for a KV cache (naming the least tensor parallel that fits)."""
    plan = _plan(target_cfg, drafter_cfg, world, gpu_bytes, dtype, page_size, max_model_len, max_batch, max_budget)
    if plan is not None:
        return plan
    weights = sum(_target_bytes(target_cfg, world, dtype).values()) / GIB
    fits = next((n for n in range(world + 1, 257) if _fits(target_cfg, drafter_cfg, n, gpu_bytes, dtype, page_size,
                                                          max_model_len, max_batch, max_budget)), None)
    advice = f"tensor parallel {fits} fits" if fits else "no tensor parallel up to 256 fits"
    raise ValueError(f"{weights:.1f} GiB of target weights a rank at tensor parallel {world} leave no room for a KV cache "
                     f"on GPUs of {gpu_bytes / GIB:.1f} GiB: {advice}")


def _target_bytes(target_cfg, world: int, dtype: torch.dtype) -> dict[str, int]:
    """A rank's target weights by part, counted on rank 0's model on the meta device (every rank
    holds equal parts: each split divides); a tied lm_head is the embedding's."""
    from ..models.target import Target

    with torch.device("meta"):
        model = Target(target_cfg, shard=Shard(0, world, _COUNTING if world > 1 else None))
    return parameter_bytes(model, dtype, ("lm_head",) if target_cfg.tie_word_embeddings else ())


def _fits(*args) -> bool:
    try:
        return _plan(*args) is not None
    except ValueError:  # this many ranks do not divide the heads, experts or vocabulary
        return False


def _plan(target_cfg, drafter_cfg, world, gpu_bytes, dtype, page_size, max_model_len, max_batch,
          max_budget) -> MemoryPlan | None:
    from ..models.drafter import Drafter

    if world < 1:
        raise ValueError(f"tensor parallel must be at least 1, got {world}")
    max_model_len = max_model_len or min(target_cfg.max_position_embeddings, 8192)
    target = _target_bytes(target_cfg, world, dtype)
    element = torch.empty(0, dtype=dtype).element_size()
    drafter_bytes, cache_bytes, depth = 0, 0, 0
    if drafter_cfg is not None:
        with torch.device("meta"):
            drafter_bytes = sum(parameter_bytes(Drafter(drafter_cfg), dtype).values())
        depth = drafter_cfg.block_size - 1
        capacity = drafter_capacity(max_model_len, PREFILL_CHUNK, depth)
        cache_bytes = 2 * drafter_cfg.num_hidden_layers * max_batch * capacity * drafter_cfg.num_key_value_heads \
            * drafter_cfg.head_dim * element
    page_bytes = kv_page_bytes(target_cfg, page_size, element)
    free = gpu_bytes - CONTEXT_BYTES - sum(target.values()) - drafter_bytes
    if free * KV_MEMORY_FRACTION - cache_bytes < 2 * page_bytes:
        return None
    width = pages_for(max_model_len + max(max_budget, depth) + 1, page_size)
    return MemoryPlan(world, gpu_bytes, target, drafter_bytes, cache_bytes, page_bytes,
                      pages_that_fit(page_bytes, free, max_batch * width), page_size, max_batch, max_model_len)
