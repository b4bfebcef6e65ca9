"""The MoE router after its GEMM: one Triton kernel (fused_route, one program per token turns the
logits into the top-k weights and expert ids) and its reference (route_reference, at the end).

Per token, in registers ([G, S]: n_group groups of S = E / n_group experts):

    scores   sigmoid(logits), or softmax over the E experts
    choice   scores + e_score_correction_bias (noaux_tc), else scores
    groups   when limited: group score = top-2 sum (noaux_tc) or max (group_limited_greedy) of
             its choice values; experts outside the topk_group best groups get choice -inf
    top-k    k times: the open expert of largest choice, ties to the lowest expert id
    weights  the *unbiased* scores of the chosen experts, / (their sum + 1e-20) if norm_topk_prob,
             times routed_scaling_factor

Tie rule (groups and experts alike): the larger value first, equal values by ascending index, as
a stable descending sort; the reference sorts so too (torch.topk leaves tie order open).
One launch with a grid of T programs, no host read: CUDA-graph capturable.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton import knobs
from triton.language.extra import libdevice

from .launch import launch_flags, require_kernel_device, wait_for_producers

MAX_EXPERTS = 1024  # a token's scores live in one program's registers
# One warp holds up to 512 scores in 16 registers per lane and reduces with shuffles, no shared
# memory; a guess, not measured on the H200.
NUM_WARPS = 1
_NONE: tl.constexpr = tl.constexpr(1 << 30)  # "no index", above every expert and group index
_GROUP_SCORES = {"noaux_tc": 1, "group_limited_greedy": 2}  # kernel's GROUP_SCORE; 0: no limits


@triton.jit
def _pick(value, index, open_):
    """One-hot mask of the open element with the largest value, ties to the lowest index."""
    best = tl.max(tl.where(open_, value, float("-inf")))
    return index == tl.min(tl.where(open_ & (value == best), index, _NONE))


@triton.jit
def _exp(x, CUDA_EXP: tl.constexpr):
    # libdevice's exp is CUDA's expf, which torch's sigmoid and softmax call; tl.exp lowers to the
    # faster ex2.approx, a few ulp off. The interpreter has no libdevice (NumPy's exp there).
    if CUDA_EXP:
        return libdevice.exp(x)
    return tl.exp(x)


@triton.jit
def _router_kernel(
    logits_ptr, bias_ptr, weights_ptr, ids_ptr,
    n_group, group_size, stride_lt, scaling,
    TOP_K: tl.constexpr, K_PAD: tl.constexpr, TOPK_GROUP: tl.constexpr,
    G_PAD: tl.constexpr, S_PAD: tl.constexpr,
    SOFTMAX: tl.constexpr, HAS_BIAS: tl.constexpr, GROUP_SCORE: tl.constexpr, NORM: tl.constexpr,
    CUDA_EXP: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_producers(PDL)
    token = tl.program_id(0).to(tl.int64)
    offs_g = tl.arange(0, G_PAD)
    offs_s = tl.arange(0, S_PAD)
    expert = offs_g[:, None] * group_size + offs_s[None, :]  # [G_PAD, S_PAD], ascending row-major
    valid = (offs_g < n_group)[:, None] & (offs_s < group_size)[None, :]
    logit = tl.load(logits_ptr + token * stride_lt + expert, mask=valid, other=float("-inf"))
    if SOFTMAX:
        e = _exp(logit - tl.max(logit), CUDA_EXP)  # padding: exp(-inf) = 0
        score = tl.math.div_rn(e, tl.sum(e))  # an IEEE divide, as torch's (tl's "/" is approximate)
    else:
        score = tl.math.div_rn(1.0, 1.0 + _exp(-logit, CUDA_EXP))
    choice = score
    if HAS_BIAS:
        choice += tl.load(bias_ptr + expert, mask=valid, other=0.0).to(tl.float32)
    choice = tl.where(valid, choice, float("-inf"))

    if GROUP_SCORE != 0:
        first = tl.max(choice, 1)  # [G_PAD]
        if GROUP_SCORE == 1:  # noaux_tc: the top two, a repeated maximum counting twice
            at = tl.min(tl.where(choice == first[:, None], offs_s[None, :], _NONE), 1)
            second = tl.max(tl.where(offs_s[None, :] == at[:, None], float("-inf"), choice), 1)
            group_score = first + second
        else:  # group_limited_greedy: the maximum
            group_score = first
        keep = offs_g < 0  # all False
        for _ in tl.static_range(TOPK_GROUP):
            keep |= _pick(group_score, offs_g, (offs_g < n_group) & ~keep)
        choice = tl.where(keep[:, None], choice, float("-inf"))

    offs_k = tl.arange(0, K_PAD)
    taken = valid & ~valid
    weights = tl.zeros([K_PAD], tl.float32)
    ids = tl.zeros([K_PAD], tl.int64)
    for j in tl.static_range(TOP_K):
        hit = _pick(choice, expert, valid & ~taken)
        taken |= hit
        weights = tl.where(offs_k == j, tl.sum(tl.where(hit, score, 0.0)), weights)
        ids = tl.where(offs_k == j, tl.min(tl.where(hit, expert, _NONE)).to(tl.int64), ids)
    if NORM:
        weights = tl.math.div_rn(weights, tl.sum(weights) + 1e-20)  # padding lanes hold 0
    k_ok = offs_k < TOP_K
    tl.store(weights_ptr + token * TOP_K + offs_k, weights * scaling, mask=k_ok)
    tl.store(ids_ptr + token * TOP_K + offs_k, ids, mask=k_ok)


def _check(logits, bias, top_k, scoring_func, topk_method, n_group, topk_group) -> None:
    if logits.dim() != 2 or logits.dtype != torch.float32 or logits.stride(-1) != 1:
        raise ValueError(f"logits must be float32 [T, E], contiguous in E, got {logits.dtype} "
                         f"{list(logits.shape)} with strides {logits.stride()}")
    experts = logits.shape[1]
    if not 1 <= experts <= MAX_EXPERTS:
        raise ValueError(f"logits must have 1 to {MAX_EXPERTS} experts (columns), got {experts}")
    if bias is not None and (bias.shape != (experts,) or not bias.is_floating_point() or not bias.is_contiguous()
                             or bias.device != logits.device):
        raise ValueError(f"bias must be a contiguous float [E={experts}] on {logits.device}, "
                         f"got {bias.dtype} {list(bias.shape)} on {bias.device}")
    if not 1 <= top_k <= experts:
        raise ValueError(f"top_k must be in [1, E={experts}], got {top_k}")
    if scoring_func not in ("sigmoid", "softmax"):
        raise ValueError(f"scoring_func must be 'sigmoid' or 'softmax', got {scoring_func!r}")
    if n_group < 1 or experts % n_group:
        raise ValueError(f"n_group must divide E={experts}, got {n_group}")
    if n_group > 1 and topk_method in _GROUP_SCORES:
        if not 1 <= topk_group <= n_group:
            raise ValueError(f"topk_group must be in [1, n_group={n_group}], got {topk_group}")
        if topk_method == "noaux_tc" and experts // n_group < 2:
            raise ValueError(f"noaux_tc scores a group by its top two experts: E / n_group = "
                             f"{experts} / {n_group} must be >= 2")
    require_kernel_device(logits.device, "fused_route")


def fused_route(
    logits: torch.Tensor,
    bias: torch.Tensor | None,
    top_k: int,
    *,
    scoring_func: str = "sigmoid",
    topk_method: str = "noaux_tc",
    n_group: int = 1,
    topk_group: int = 1,
    norm_topk_prob: bool = True,
    routed_scaling_factor: float = 1.0,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
    pdl: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k routing of T tokens over E experts (the arguments after top_k are TargetConfig's).

    logits:  float32 [T, E], contiguous in E: the router GEMM's output.
    bias:    None or [E] float (any float dtype, read as float32), contiguous:
             e_score_correction_bias, added to the scores for the choice only.
    top_k:   experts per token, 1 <= top_k <= E.
    scoring_func: "sigmoid" or "softmax".
    topk_method, n_group, topk_group: groups are limited when n_group > 1 and topk_method is
             "noaux_tc" (group score: top-2 sum) or "group_limited_greedy" (max); n_group divides E.
    out:     optional (weights float32 [T, top_k], ids int64 [T, top_k]) contiguous buffers.
    pdl:     ops/launch.py.
    Returns (weights float32 [T, top_k], ids int64 [T, top_k]); choice order: descending choice
    value, ties to the lower expert id. NaN logits give undefined ids.
    """
    _check(logits, bias, top_k, scoring_func, topk_method, n_group, topk_group)
    tokens, experts = logits.shape
    if out is None:
        out = (torch.empty(tokens, top_k, dtype=torch.float32, device=logits.device),
               torch.empty(tokens, top_k, dtype=torch.int64, device=logits.device))
    weights, ids = out
    for name, t, dtype in (("weights", weights, torch.float32), ("ids", ids, torch.int64)):
        if t.shape != (tokens, top_k) or t.dtype != dtype or t.device != logits.device or not t.is_contiguous():
            raise ValueError(f"out {name} must be a contiguous {dtype} [{tokens}, {top_k}] on {logits.device}, "
                             f"got {t.dtype} {list(t.shape)} on {t.device}")
    group_score = _GROUP_SCORES.get(topk_method, 0) if n_group > 1 else 0
    groups = n_group if group_score else 1
    if tokens:
        _router_kernel[(tokens,)](
            logits, bias if bias is not None else logits, weights, ids,  # logits: an unread stand-in
            groups, experts // groups, logits.stride(0), float(routed_scaling_factor),
            TOP_K=top_k, K_PAD=triton.next_power_of_2(top_k), TOPK_GROUP=topk_group if group_score else 1,
            G_PAD=triton.next_power_of_2(groups), S_PAD=triton.next_power_of_2(experts // groups),
            SOFTMAX=scoring_func == "softmax", HAS_BIAS=bias is not None, GROUP_SCORE=group_score,
            NORM=bool(norm_topk_prob), CUDA_EXP=not knobs.runtime.interpret, num_warps=NUM_WARPS,
            **launch_flags(logits.device, pdl),
        )
    return weights, ids


def top_indices(x: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest values along the last dim, largest first, equal values by ascending
    index (a stable sort). torch.topk leaves tie order open: on the CPU it returned [4, 7, 5] for
    the top three of [1, 3, 3, 2, 3, 3, 0, 3]. The kernel breaks ties so too."""
    return x.sort(dim=-1, descending=True, stable=True).indices[..., :k].contiguous()


def route_reference(logits: torch.Tensor, bias: torch.Tensor | None, top_k: int, *, scoring_func: str = "sigmoid",
                    topk_method: str = "noaux_tc", n_group: int = 1, topk_group: int = 1, norm_topk_prob: bool = True,
                    routed_scaling_factor: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """fused_route in PyTorch, the specification (same arguments, any device, autograd through
    the weights): logits float32 [T, E] -> (weights float32 [T, top_k], ids int64 [T, top_k])."""
    scores = logits.sigmoid() if scoring_func == "sigmoid" else logits.softmax(-1)
    choice = scores if bias is None else scores + bias.float()
    if n_group > 1 and topk_method in ("noaux_tc", "group_limited_greedy"):
        grouped = choice.view(logits.shape[0], n_group, -1)
        group_score = grouped.topk(2, -1).values.sum(-1) if topk_method == "noaux_tc" else grouped.max(-1).values
        keep = torch.zeros_like(group_score).scatter_(1, top_indices(group_score, topk_group), 1.0)
        choice = choice.masked_fill(~keep.bool().repeat_interleave(grouped.shape[-1], 1), float("-inf"))
    ids = top_indices(choice, top_k)
    weights = scores.gather(1, ids)
    if norm_topk_prob:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return weights * routed_scaling_factor, ids
