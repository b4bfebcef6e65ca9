"""A benchmark-only drafter that replays the demo pair's recorded rounds on a real-size target.

Random weights give no real acceptance, so on the Moonlight and Kimi K2 shapes this drafter
stands in for a trained one: it runs the wrapped drafter (so its pass costs what it costs), then
replaces the logits. Each (slot, round) draws one round recorded on the demo pair
(benchmarks/record_acceptance.py), by a hash of the slot and its context length, and at every
depth d puts the target's known next token (the greedy continuation, set per slot as in
benchmarks/oracle.py) at the rank the demo pair's target token had, with the drafter's recorded top-K
log-probabilities; the other ranks hold other tokens, and the rest of the probability mass is
spread evenly over the rest of the vocabulary. So per depth the rank of the target's token and the
drafter's probabilities follow the demo pair's distributions, whole rounds at a time (the
correlations between depths kept). `wrong=True` keeps the probabilities but never ranks the
target's token: a drafter that is always wrong, and sure of itself.

Everything runs on the device without host reads, so rounds stay capturable in CUDA graphs.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

from oracle import OracleDrafter

RECORDED = Path(__file__).resolve().parent / "data" / "demo_acceptance.safetensors"
_MIX = 0x9E3779B97F4A7C15 >> 2  # an odd 62-bit multiplier: slots and lengths spread over the recorded rounds


class ReplayDrafter(OracleDrafter):
    """Wraps a Drafter (same interface). sequences: int64 [max_batch, max_len], each slot's prompt +
    greedy continuation, -1 where unknown (OracleDrafter.set_sequence)."""

    def __init__(self, drafter, max_batch: int, max_len: int, recorded: Path = RECORDED, wrong: bool = False,
                 seed: int = 0):
        super().__init__(drafter, max_batch, max_len)
        device = drafter.fc.weight.device
        data = load_file(str(recorded))
        ranks, logprobs = data["ranks"].long(), data["logprobs"].float()
        depth = drafter.cfg.block_size - 1
        if ranks.shape[1] < depth:
            raise ValueError(f"{recorded} holds {ranks.shape[1]} depths; this drafter drafts {depth}")
        self.recorded_ranks = ranks[:, :depth].to(device)
        self.ranks = self.recorded_ranks.clone()  # what draft_logits reads (a CUDA graph holds its address)
        self.wrong = wrong
        self.logprobs = logprobs[:, :depth].to(device)  # [R, D, K]
        mass = self.logprobs.exp().sum(-1).clamp_max(1.0)  # [R, D]
        rest = drafter.cfg.vocab_size - self.logprobs.shape[2]
        # Below the K-th log-prob, so that the top K are exactly the recorded ones.
        self.rest_logprob = torch.minimum(((1 - mass).clamp_min(1e-30) / rest).log(), self.logprobs[..., -1] - 1e-3)
        self.seed = seed

    @property
    def wrong(self) -> bool:
        return self._wrong

    @wrong.setter
    def wrong(self, value: bool) -> None:
        """True: the target's token is never among the top K (the probabilities stay as recorded)."""
        self._wrong = bool(value)
        self.ranks.copy_(torch.full_like(self.recorded_ranks, -1) if value else self.recorded_ranks)

    def draft_logits(self, target, bonus: torch.Tensor, cache, key_limit: int | None = None) -> torch.Tensor:
        """As Drafter.draft_logits, with the replayed distributions (float32 [B, D, V]: replayed
        log-probs are not values of the model's dtype)."""
        logits = self.inner.draft_logits(target, bonus, cache, key_limit)
        b, depth, vocab = logits.shape
        k = self.logprobs.shape[2]
        slots = torch.arange(b, device=logits.device)
        pick = ((slots * 1_000_003 + cache.next_positions().long() * _MIX + self.seed) & ((1 << 62) - 1)) % self.ranks.shape[0]
        ranks, lp = self.ranks[pick], self.logprobs[pick]  # [B, D], [B, D, K]
        steps = torch.arange(1, depth + 1, device=logits.device)
        positions = (cache.next_positions().long()[:, None] + steps).clamp_max(self.sequences.shape[1] - 1)
        truth = self.sequences[:b].gather(1, positions)  # [B, D], -1 where unknown
        ranks = torch.where(truth >= 0, ranks, -1)
        # Rank i holds token truth - rank + i (mod V): the truth at its rank, and ids rising with
        # the rank, so equal recorded log-probs (ties break by token id) keep the recorded order.
        # Without a rank (not in the top K, or unknown) the ranks hold truth + 1 + i.
        # Where the truth is unknown (the engine's cost stand-ins, past a continuation's end), the
        # ranks start at a token hashed from slot, length and depth: trees of distinct tokens that
        # route over the experts as a real drafter's do, not the same few ids in every slot.
        seed = (slots * 1_000_003 + cache.next_positions().long() * _MIX + self.seed)[:, None] + steps * 7_919
        anchor = torch.where(truth >= 0, truth, (seed & ((1 << 62) - 1)) % vocab)
        offsets = torch.arange(k, device=logits.device)
        first = anchor - torch.where(ranks >= 0, ranks, -1)
        tokens = (first[..., None] + offsets) % vocab  # [B, D, K]
        replayed = self.rest_logprob[pick][..., None].expand(b, depth, vocab).clone()
        return replayed.scatter_(2, tokens, lp)
