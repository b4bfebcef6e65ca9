"""Deterministic top-k of the drafter's logits with float32 log-softmax values."""

from __future__ import annotations

import torch

from ..ops.launch import require_kernel_device
from .topk_triton import MAX_K, topk_logprobs_triton

_FLIP_MAGNITUDE = 0x7FFFFFFF  # flips every bit but the sign of a float32's bit pattern


def sort_keys(logits32: torch.Tensor) -> torch.Tensor:
    """Unique int64 keys whose descending order is (logit descending, token id ascending).

    logits32: float32 [..., V]. High 32 bits: the float's bit pattern mapped to a signed integer
    of the same order (negative floats have their magnitude bits flipped); low 32 bits:
    V - 1 - token, so an equal logit ranks the smaller token id first. -0.0 is folded into +0.0
    first because the two compare equal.
    """
    vocab = logits32.shape[-1]
    bits = (logits32 + 0.0).view(torch.int32)
    ordered = torch.where(bits < 0, bits ^ _FLIP_MAGNITUDE, bits).to(torch.int64)
    reverse_ids = torch.arange(vocab - 1, -1, -1, device=logits32.device, dtype=torch.int64)
    return (ordered << 32) | reverse_ids


def topk_logprobs(logits: torch.Tensor, k: int, *, backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """The k best tokens of every row and their log-softmax values.

    logits: [B, D, V], any float dtype. k: 1 <= k <= V.
    backend: "reference" (packed sort keys + torch.topk, any device), "triton" (the same keys in
             two Triton launches: fp16 / bf16 / fp32, k <= topk_triton.MAX_K), "auto" (triton on
             CUDA where it applies).
    Returns logprobs float32 [B, D, k] and tokens int64 [B, D, k], ordered by logit descending,
    equal logits by smaller token id first (a bare torch.topk leaves that order unspecified).
    Both backends pick the same tokens; log-probs agree to float32 rounding of the normalizer.
    No host synchronization and no data-dependent allocation.
    """
    if logits.dim() != 3:
        raise ValueError(f"logits must be [B, D, V], got shape {tuple(logits.shape)}")
    if not logits.dtype.is_floating_point:
        raise TypeError(f"logits must be a float tensor, got {logits.dtype}")
    vocab = logits.shape[-1]
    if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= vocab:
        raise ValueError(f"k must be an int in [1, V={vocab}], got {k!r}")
    if backend not in ("auto", "reference", "triton"):
        raise ValueError(f"backend must be 'auto', 'reference' or 'triton', got {backend!r}")
    fits = logits.dtype in (torch.float16, torch.bfloat16, torch.float32) and k <= MAX_K
    if backend == "triton" and not fits:
        raise ValueError(f"the triton top-k takes fp16 / bf16 / fp32 logits and k <= {MAX_K}, got {logits.dtype} "
                         f"and k={k}")
    if backend == "triton" or (backend == "auto" and fits and logits.is_cuda):
        require_kernel_device(logits.device, "backend='triton'")
        return topk_logprobs_triton(logits, k)
    return topk_logprobs_reference(logits, k)


def topk_logprobs_reference(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference top-k (validated inputs): unique packed keys make torch.topk's order exact."""
    if logits.dtype == torch.float64:
        # Too wide for the packed key; a stable sort keeps equal logits in token order.
        tokens = torch.sort(logits, dim=-1, descending=True, stable=True).indices[..., :k]
        logprobs = logits.gather(-1, tokens) - torch.logsumexp(logits, dim=-1, keepdim=True)
        return logprobs.float(), tokens
    logits32 = logits.float()  # exact for fp16 / bf16 / fp32
    tokens = torch.topk(sort_keys(logits32), k, dim=-1, sorted=True).indices
    logprobs = logits32.gather(-1, tokens) - torch.logsumexp(logits32, dim=-1, keepdim=True)
    return logprobs, tokens
