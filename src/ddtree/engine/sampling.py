"""Sampling parameters and the target's choice at every row: greedy, or a Gumbel-max sample.

The noise is a function of (request seed, absolute position, token id) only: a counter-based hash,
no generator state. The target's choice after a row then depends on that row's logits and its
position alone, so `ar`, `chain` and `ddtree` commit the same tokens for one seed, and a request's
output does not depend on the rest of its batch. Filtering follows transformers' order:
temperature, then top-k, then top-p over the renormalized top-k set.
"""

from __future__ import annotations

import math
import secrets
from dataclasses import dataclass

import torch

from ..tree.topk import sort_keys

MAX_SEED = (1 << 63) - 1
_MASK32 = 0xFFFFFFFF
_GOLDEN = 0x9E3779B9  # 2^32 / golden ratio: a Weyl step that spreads consecutive token ids


@dataclass(frozen=True)
class SamplingParams:
    """Per-request decoding settings. temperature 0 is greedy (argmax, first index on ties)."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0: no top-k cut
    seed: int | None = None  # None: a fresh random seed, reported in the output
    max_new_tokens: int = 128
    stop: tuple[str, ...] = ()  # stop strings: the text ends before the first one
    stop_token_ids: tuple[int, ...] = ()  # extra stop tokens beside the model's end-of-text ids
    ignore_eos: bool = False

    def __post_init__(self):
        def bad(field: str, why: str):
            raise ValueError(f"{field} {why}, got {getattr(self, field)!r}")

        if isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float)) \
                or not math.isfinite(self.temperature) or self.temperature < 0:
            bad("temperature", "must be a finite number >= 0")
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            bad("top_p", "must be in (0, 1]")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            bad("top_k", "must be an int >= 0")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed <= MAX_SEED):
            bad("seed", f"must be None or an int in [0, {MAX_SEED}]")
        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            bad("max_new_tokens", "must be an int >= 1")
        if not all(isinstance(s, str) and s for s in self.stop):
            bad("stop", "must hold non-empty strings")
        if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.stop_token_ids):
            bad("stop_token_ids", "must hold token ids >= 0")

    def with_seed(self) -> "SamplingParams":
        """These parameters with a concrete seed (a fresh one when seed is None)."""
        if self.seed is not None:
            return self
        return SamplingParams(**{**self.__dict__, "seed": secrets.randbits(63)})


# -- the counter-based noise -------------------------------------------------------------------

def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2^32 for x in [0, 2^32) held in int64, without overflowing int64."""
    lo, hi = c & 0xFFFF, c >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & _MASK32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer finalizer (lowbias32, Wellons): a bijection that mixes every bit."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def row_keys(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """int64 [...] 32-bit keys of (seed, position): seeds int64 [...], positions int64 [...]."""
    lo, hi = seeds & _MASK32, (seeds >> 32) & _MASK32
    return _mix32(_mix32(_mix32(lo) ^ hi) ^ (positions & _MASK32))


def gumbel_noise(seeds: torch.Tensor, positions: torch.Tensor, vocab: int) -> torch.Tensor:
    """float32 [..., vocab] standard Gumbel noise, a function of (seed, position, token) only.

    seeds int64 [...] (broadcast with positions), positions int64 [...]: the absolute position of
    the token being chosen. u = (top 23 bits + 0.5) / 2^23 lies in (0, 1); g = -log(-log(u)).
    """
    key = row_keys(seeds, positions)[..., None]
    tokens = torch.arange(vocab, device=positions.device, dtype=torch.int64)
    bits = _mix32((key + _mul32(tokens, _GOLDEN)) & _MASK32)
    u = ((bits >> 9).to(torch.float32) + 0.5) * (1.0 / (1 << 23))  # exact in float32, never 0 or 1
    return -torch.log(-torch.log(u))


# -- the choice --------------------------------------------------------------------------------

def filter_mask(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """bool [..., V]: tokens kept by top-k, then top-p over the renormalized top-k set.

    logits float32 [..., V]; temperature / top_p float32 [...], top_k int64 [...] (0 = no cut).
    Ranks follow (logit descending, token id ascending), so ties are cut deterministically. A row
    keeps token i of its sorted order when the top-k mass before i is below top_p of the top-k
    mass: the smallest prefix whose mass reaches top_p, never empty.
    """
    vocab = logits.shape[-1]
    order = sort_keys(logits).argsort(dim=-1, descending=True)
    scaled = logits.gather(-1, order) / temperature.clamp_min(1e-6)[..., None]
    probs = torch.softmax(scaled, dim=-1)
    ranks = torch.arange(vocab, device=logits.device)
    k = torch.where(top_k > 0, top_k, vocab)[..., None]
    probs = probs * (ranks < k)
    mass_before = probs.cumsum(-1) - probs
    keep_sorted = (ranks < k) & (mass_before < top_p[..., None] * probs.sum(-1, keepdim=True))
    return torch.zeros_like(keep_sorted).scatter_(-1, order, keep_sorted)


def choose_tokens(
    logits: torch.Tensor,
    positions: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    seeds: torch.Tensor,
    *,
    any_sampled: bool = True,
    any_filtered: bool = True,
) -> torch.Tensor:
    """The target's choice after every row: int64 [B, N].

    logits float32 [B, N, V]; positions int64 [B, N], the absolute position of the token chosen;
    temperature float32 [B] (0 = greedy), top_k int64 [B], top_p float32 [B], seeds int64 [B].
    any_sampled / any_filtered: host-known shortcuts (some temperature > 0; some top-k or top-p
    cut); with both False this is a plain argmax. No host synchronization.
    """
    greedy = logits.argmax(-1)
    if not any_sampled:
        return greedy
    t = temperature[:, None].expand(positions.shape)
    scores = logits / t.clamp_min(1e-6)[..., None] + gumbel_noise(seeds[:, None], positions, logits.shape[-1])
    if any_filtered:
        keep = filter_mask(logits, t, top_k[:, None].expand(positions.shape), top_p[:, None].expand(positions.shape))
        scores = scores.masked_fill(~keep, float("-inf"))
    return torch.where(t > 0, scores.argmax(-1), greedy)


# -- the plain reference -----------------------------------------------------------------------

def _mix32_int(x: int) -> int:
    x ^= x >> 16
    x = (x * 0x7FEB352D) & _MASK32
    x ^= x >> 15
    x = (x * 0x846CA68B) & _MASK32
    return x ^ (x >> 16)


def choose_token_reference(logits: list[float], position: int, params: SamplingParams) -> int:
    """One row in plain Python (float64 filtering, integer hashing): the specification of
    choose_tokens. logits: V floats; position: absolute position of the token chosen."""
    vocab = len(logits)
    if params.temperature == 0:
        return max(range(vocab), key=lambda v: (logits[v], -v))
    order = sorted(range(vocab), key=lambda v: (-logits[v], v))
    k = params.top_k or vocab
    top = order[:k]
    peak = max(logits[v] / params.temperature for v in top)
    weights = [math.exp(logits[v] / params.temperature - peak) for v in top]
    total, kept, before = sum(weights), [], 0.0
    for v, w in zip(top, weights):
        if before < params.top_p * total:
            kept.append(v)
        before += w
    seed = params.seed
    key = _mix32_int(_mix32_int(_mix32_int(seed & _MASK32) ^ ((seed >> 32) & _MASK32)) ^ (position & _MASK32))

    def gumbel(v: int) -> float:
        bits = _mix32_int((key + v * _GOLDEN) & _MASK32)
        u = ((bits >> 9) + 0.5) / (1 << 23)
        return -math.log(-math.log(u))

    return max(kept, key=lambda v: (logits[v] / params.temperature + gumbel(v), -v))
