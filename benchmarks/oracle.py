"""A drafter whose proposals are replaced by a known continuation (benchmarks and the engine tests).

The wrapped drafter still runs, so its pass costs what it costs; then, for every slot whose
continuation is known, the first `depth` drafted positions put all their mass on the known
tokens. With the target's own greedy continuation this forces commits of a chosen length, so
speedups at acceptance length L can be measured and deep commits exercised.
"""

from __future__ import annotations

import torch

_SURE = 1e4  # logit of the known token; every other token sits at -_SURE


class OracleDrafter:
    """Wraps a Drafter (same interface). sequences: int64 [max_batch, T] on the drafter's device,
    the full token sequence (prompt + continuation) of each slot, -1 where unknown."""

    def __init__(self, drafter, max_batch: int, max_len: int, depth: int | None = None):
        self.inner = drafter
        self.cfg = drafter.cfg
        device = drafter.fc.weight.device
        self.sequences = torch.full((max_batch, max_len), -1, dtype=torch.int64, device=device)
        self._depth = torch.zeros((), dtype=torch.int64, device=device)  # on the device: a CUDA graph reads it
        self.depth = drafter.cfg.block_size - 1 if depth is None else depth

    @property
    def depth(self) -> int:
        """Drafted positions replaced by the known continuation (forced acceptance: depth + 1)."""
        return int(self._depth)

    @depth.setter
    def depth(self, value: int) -> None:
        self._depth.fill_(value)

    def set_sequence(self, slot: int, tokens: list[int]) -> None:
        self.sequences[slot] = -1
        self.sequences[slot, : len(tokens)] = torch.tensor(tokens, dtype=torch.int64)

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def draft_logits(self, target, bonus: torch.Tensor, cache, key_limit: int | None = None) -> torch.Tensor:
        """As Drafter.draft_logits; drafted position d (1-based) of slot b is the token at
        sequence position next_positions()[b] + d, known when d <= depth and the sequence reaches it."""
        logits = self.inner.draft_logits(target, bonus, cache, key_limit)
        b, depth, vocab = logits.shape
        steps = torch.arange(1, depth + 1, device=logits.device)
        positions = cache.next_positions()[:, None] + steps
        seq = self.sequences[:b]
        known = seq.gather(1, positions.clamp_max(seq.shape[1] - 1))
        use = (positions < seq.shape[1]) & (known >= 0) & (steps <= self._depth)
        sure = torch.full_like(logits, -_SURE).scatter_(2, known.clamp_min(0)[..., None], _SURE)
        return torch.where(use[..., None], sure, logits)
