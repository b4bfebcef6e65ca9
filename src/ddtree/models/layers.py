"""The target's layers besides attention, PyTorch first: two projections in one buffer, rotary
embedding with DeepSeek's YaRN scaling, RMSNorm, the SwiGLU MLP, the MoE router and the MoE.

RMSNorm, the router and the MoE hold a KernelPolicy (ops/policy.py): it says whether a forward runs
their Triton kernels (ops/norm.py, ops/router.py, ops/moe.py) or the PyTorch reference beside them.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..ops.gemm import linear as few_row_linear
from ..ops.int4 import VALUES_PER_WORD, PackedInt4
from ..ops.launch import DTYPES as KERNEL_DTYPES
from ..ops.moe import SharedExperts, fused_moe
from ..ops.moe_grouped import grouped_moe
from ..ops.moe_align import token_chunks
from ..ops.norm import rms_norm, rms_norm_reference
from ..ops.policy import KernelPolicy
from ..ops.router import fused_route, route_reference
from ..parallel.shard import SINGLE, Shard
from .config import TargetConfig
from .int4_order import InterleavedInt4Experts

# -- projections of one input in one buffer --------------------------------------------------
# Parameter names, shapes and state_dict stay as they were: each weight is a view of the joint
# buffer. A later .to() or reassignment splits them again, and the caller falls back to one GEMM each.

def join(*linears: nn.Linear) -> None:
    """Move the weights ([out_i, in] each) into one [sum out_i, in] buffer, values kept."""
    joint = torch.cat([linear.weight.detach() for linear in linears])
    start = 0
    for linear in linears:
        rows = linear.weight.shape[0]
        linear.weight = nn.Parameter(joint[start : start + rows], requires_grad=linear.weight.requires_grad)
        start += rows


def joint_weight(*linears: nn.Linear) -> torch.Tensor | None:
    """[sum out_i, in]: the weights as one view when they are adjacent in memory (join), bias-free
    and no gradient is wanted (the view would feed only one of them); else None."""
    weights = [linear.weight for linear in linears]
    if torch.is_grad_enabled() and any(w.requires_grad for w in weights):
        return None
    if any(linear.bias is not None for linear in linears):
        return None
    first = weights[0]
    if any(w.dtype != first.dtype or w.device != first.device or not w.is_contiguous() for w in weights):
        return None
    for a, b in zip(weights, weights[1:]):
        if b.data_ptr() != a.data_ptr() + a.numel() * a.element_size():
            return None
        # Adjacent is not enough: two separate allocations can sit back to back (the CUDA caching
        # allocator did so on the H200 after a .to()); the view must stay inside one storage.
        if a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
            return None
    rows = sum(w.shape[0] for w in weights)
    return first.as_strided((rows, first.shape[1]), (first.shape[1], 1))


def joint_output(linears: tuple[nn.Linear, ...], x: torch.Tensor, linear=F.linear) -> torch.Tensor | None:
    """[..., sum out_i]: every projection of x [..., in] from one GEMM over the joint view
    (joint_weight), or None when there is none."""
    joint = joint_weight(*linears)
    return None if joint is None else linear(x, joint)


def project(linears: tuple[nn.Linear, ...], x: torch.Tensor, linear=F.linear) -> tuple[torch.Tensor, ...]:
    """(l(x) for l in linears) for x [..., in]: one GEMM over the joint view when there is one.
    `linear(x, weight)` computes it (ops/gemm.linear on a decode step's kernel path; it reads the
    weights only: projections with a bias take their modules)."""
    joint = joint_output(linears, x, linear)
    if joint is None:  # the modules themselves, unless another GEMM was asked for
        return tuple(apply_linear(m, x, linear) for m in linears)
    return joint.split([m.weight.shape[0] for m in linears], dim=-1)


def apply_linear(module: nn.Linear, x: torch.Tensor, linear=F.linear) -> torch.Tensor:
    """module(x), by `linear(x, weight)` where one is asked and the module has no bias."""
    return module(x) if linear is F.linear or module.bias is not None else linear(x, module.weight)


def both(first: nn.Linear, second: nn.Linear, x: torch.Tensor, linear=F.linear) -> tuple[torch.Tensor, torch.Tensor]:
    """(first(x), second(x)): project() of two."""
    return project((first, second), x, linear)


# -- rotary embedding (YaRN) and MLA's softmax scale --------------------------------------------

def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _is_yarn(cfg: TargetConfig) -> bool:
    return bool(cfg.rope_scaling) and cfg.rope_scaling.get("type") == "yarn"


def inv_freq_and_factor(cfg: TargetConfig) -> tuple[torch.Tensor, float]:
    """Inverse frequencies float32 [qk_rope_head_dim / 2] and the cos/sin multiplier."""
    dim, base = cfg.qk_rope_head_dim, cfg.rope_theta
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    if not _is_yarn(cfg):
        return 1.0 / pos_freqs, 1.0
    rs = cfg.rope_scaling
    factor = rs.get("factor") or cfg.max_position_embeddings / rs["original_max_position_embeddings"]
    mscale, mscale_all_dim = rs.get("mscale"), rs.get("mscale_all_dim")
    attention_factor = rs.get("attention_factor")
    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = yarn_mscale(factor)
    beta_fast, beta_slow = rs.get("beta_fast") or 32, rs.get("beta_slow") or 1
    original = rs["original_max_position_embeddings"]

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rs.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp  # weight of the unscaled frequency, per pair
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention_factor)


def softmax_scale(cfg: TargetConfig) -> float:
    """(qk_nope + qk_rope)^-0.5, times YaRN's mscale(factor, mscale_all_dim)^2 when scaled."""
    scale = cfg.qk_head_dim**-0.5
    if _is_yarn(cfg) and cfg.rope_scaling.get("mscale_all_dim"):
        m = yarn_mscale(cfg.rope_scaling["factor"], cfg.rope_scaling["mscale_all_dim"])
        scale *= m * m
    return scale


def rotary_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, factor: float,
                   dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [..., T, rope_dim / 2] in dtype, times factor (YaRN's attention factor), at
    integer positions [..., T]. A forward computes them once and every layer rotates with them."""
    angles = positions[..., None].float() * inv_freq.to(positions.device)  # [..., T, rope/2]
    return (angles.cos() * factor).to(dtype), (angles.sin() * factor).to(dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool) -> torch.Tensor:
    """Rotate x [..., T, heads, rope_dim] by cos, sin [..., T, rope_dim / 2] (rotary_cos_sin).

    interleave=True: pairs (x0, x1), (x2, x3), ... share a frequency and the result is laid out
    de-interleaved (evens then odds), as DeepSeek's checkpoints expect; False: rotate-half pairs.
    """
    cos, sin = cos[..., None, :], sin[..., None, :]
    if interleave:
        x1, x2 = x[..., 0::2], x[..., 1::2]
    else:
        x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


# -- RMSNorm, the SwiGLU MLP, the router, the MoE --------------------------------------------------------


class RMSNorm(nn.Module):
    """RMSNorm, with the residual add that precedes it in a decoder layer: `norm(x)` or
    `norm(x, delta)` = (x + delta, RMSNorm(x + delta)). The kernel (ops/norm.py) when the policy
    says so; both round at the same points."""

    def __init__(self, dim: int, eps: float, policy: KernelPolicy = KernelPolicy()):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.policy = policy

    def forward(self, x: torch.Tensor, delta: torch.Tensor | None = None):
        """x [..., dim] -> RMSNorm(x) [..., dim]; with delta (x's shape), (x + delta, RMSNorm(x + delta))."""
        if self._use_kernel(x, delta):
            return rms_norm(x, self.weight, self.eps, delta, pdl=self.policy.pdl)
        if delta is None:
            return rms_norm_reference(x, self.weight, self.eps)
        x = x + delta
        return x, rms_norm_reference(x, self.weight, self.eps)

    def _use_kernel(self, x: torch.Tensor, delta: torch.Tensor | None) -> bool:
        tensors = (x, self.weight) if delta is None else (x, self.weight, delta)
        if not self.policy.kernel("RMSNorm", *tensors):
            return False
        # "auto" leaves other dtypes (float64 checks) on PyTorch; forced kernels would refuse them.
        return not self.policy.automatic or (x.dtype in KERNEL_DTYPES and self.weight.dtype in KERNEL_DTYPES and (
            delta is None or (delta.dtype == x.dtype and delta.shape == x.shape)))


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)). With a shard of several ranks each holds inter / world
    of the intermediate columns and returns its partial sum (the caller all-reduces)."""

    def __init__(self, hidden: int, inter: int, shard: Shard = SINGLE):
        super().__init__()
        mine = shard.part(inter, "an MLP's intermediate size")
        inter = mine.stop - mine.start
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def fuse_input_projections(self) -> None:
        """gate_proj and up_proj in one buffer (join): one GEMM reads the input."""
        join(self.gate_proj, self.up_proj)

    def forward(self, x: torch.Tensor, linear=F.linear) -> torch.Tensor:
        """x [..., hidden] -> [..., hidden]; `linear(x, weight)` computes the GEMMs (project())."""
        gate, up = both(self.gate_proj, self.up_proj, x, linear)
        return apply_linear(self.down_proj, F.silu(gate) * up, linear)


class Router(nn.Module):
    """Top-k expert choice per token: sigmoid scores with a correction bias and group limits
    (noaux_tc: DeepSeek-V3, Kimi K2, Moonlight) or softmax scores (greedy: DeepSeek-V2). After the
    float32 GEMM, ops/router.py's kernel or its reference, as the policy says: the same ids, ties
    included, and weights up to float32 rounding."""

    def __init__(self, cfg: TargetConfig, policy: KernelPolicy = KernelPolicy()):
        super().__init__()
        self.cfg = cfg
        self.weight = nn.Parameter(torch.empty(cfg.n_routed_experts, cfg.hidden_size))
        bias = cfg.topk_method == "noaux_tc"
        self.e_score_correction_bias = nn.Parameter(torch.zeros(cfg.n_routed_experts)) if bias else None
        self.policy = policy

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, hidden] -> (weights float32 [T, k], expert ids int64 [T, k])."""
        cfg = self.cfg
        options = dict(scoring_func=cfg.scoring_func, topk_method=cfg.topk_method, n_group=cfg.n_group,
                       topk_group=cfg.topk_group, norm_topk_prob=cfg.norm_topk_prob,
                       routed_scaling_factor=cfg.routed_scaling_factor)
        if not self.policy.kernel("Router", x, self.weight):
            return route_reference(self._logits(x), self.e_score_correction_bias, cfg.num_experts_per_tok, **options)
        return fused_route(self._logits(x, kernels=True), self.e_score_correction_bias, cfg.num_experts_per_tok,
                           pdl=self.policy.pdl, **options)

    def _logits(self, x: torch.Tensor, kernels: bool = False) -> torch.Tensor:
        """x [T, hidden] -> float32 [T, E]. On CUDA (or on the kernel path, through the few-row
        GEMM), 16-bit x and weight go through one GEMM with a float32 output: products of 16-bit
        values are exact in float32, so it is the float32 GEMM up to summation order, without the
        two casting copies per layer."""
        w = self.weight
        needs_grad = torch.is_grad_enabled() and (x.requires_grad or w.requires_grad)
        if x.dtype == w.dtype and x.dtype in (torch.bfloat16, torch.float16) and not needs_grad:
            if kernels:
                return few_row_linear(x, w, out_dtype=torch.float32, max_rows=self.policy.gemm_max_rows,
                                      pdl=self.policy.pdl)
            if x.is_cuda:
                return torch.mm(x, w.t(), out_dtype=torch.float32)
        return F.linear(x.float(), w.float())


class MoE(InterleavedInt4Experts, nn.Module):
    """Routed experts plus the shared experts. The routed experts are stored in 16 bits
    (`w_gate_up` [E, hidden, 2 * inter]: per expert [gate | up], transposed; `w_down` [E, inter,
    hidden]) or, with cfg.int4_experts, packed INT4 as the checkpoint stores them (`w_gate_up_packed`
    int32 [E, 2 * inter, hidden / 8] with `w_gate_up_scale` [E, 2 * inter, hidden / group];
    `w_down_packed` [E, hidden, inter / 8] with `w_down_scale`: ops/int4.py; on sm_90 reordered once
    after loading into the interleaved order its tiles read: int4_order.py). Two paths, the
    policy's choice (moe_fused):

    - grouped: ops/moe_grouped.grouped_moe, pairs sorted by expert for two grouped GEMMs: the reference,
      the path for many 16-bit rows (large batches of trees, long prefill chunks) and for autograd.
    - fused: ops/moe.fused_moe, which reads each touched expert's weights once per block of its
      rows, and the shared experts' in the same launches; INT4 experts take it for any number of
      rows on CUDA, in chunks the expert alignment holds.
    """

    def __init__(self, cfg: TargetConfig, policy: KernelPolicy = KernelPolicy(), shard: Shard = SINGLE):
        super().__init__()
        self.local = shard.part(cfg.n_routed_experts, "n_routed_experts")  # expert parallel: this rank's experts
        e, h, i = self.local.stop - self.local.start, cfg.hidden_size, cfg.moe_intermediate_size
        self.gate = Router(cfg, policy)
        self.int4 = cfg.int4_experts
        if self.int4 is None:
            self.w_gate_up = nn.Parameter(torch.empty(e, h, 2 * i))
            self.w_down = nn.Parameter(torch.empty(e, i, h))
        else:
            words, g = VALUES_PER_WORD, self.int4.group_size
            frozen = lambda *shape, **kw: nn.Parameter(torch.empty(*shape, **kw), requires_grad=False)  # noqa: E731
            self.w_gate_up_packed = frozen(e, 2 * i, h // words, dtype=torch.int32)
            self.w_gate_up_scale = frozen(e, 2 * i, h // g)
            self.w_down_packed = frozen(e, h, i // words, dtype=torch.int32)
            self.w_down_scale = frozen(e, h, i // g)
        self.inter = i
        self.shared_experts = MLP(h, i * cfg.n_shared_experts, shard) if cfg.n_shared_experts else None
        self.policy, self.shard = policy, shard

    def experts(self) -> tuple[torch.Tensor | PackedInt4, torch.Tensor | PackedInt4]:
        """(w_gate_up, w_down) as ops/moe.py takes them: tensors, or INT4 PackedInt4."""
        if self.int4 is None:
            return self.w_gate_up, self.w_down
        g = self.int4.group_size
        return (PackedInt4(self.w_gate_up_packed, self.w_gate_up_scale, g, self.int4_interleaved),
                PackedInt4(self.w_down_packed, self.w_down_scale, g, self.int4_interleaved))

    def forward(self, x: torch.Tensor, router_ids: list[torch.Tensor] | None = None) -> torch.Tensor:
        """x [..., hidden] -> [..., hidden] (with a shard of several ranks: this rank's partial sum,
        its experts' share and its columns of the shared experts; the caller all-reduces);
        router_ids, when a list, receives the expert ids int64 [tokens, k] this call routed to (the
        engine counts the experts a verify touched)."""
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        weights, ids = self.gate(x)
        if router_ids is not None:
            router_ids.append(ids)
        if self.shard.world > 1:  # other ranks' experts: id -1, which both paths drop
            local = ids - self.local.start
            ids = torch.where((local >= 0) & (local < self.local.stop - self.local.start), local, -1)
        shared = None
        w_gate_up, w_down = self.experts()
        # The fused path reads the shared MLP's weights too: autograd on any of them keeps PyTorch.
        others = list(self.shared_experts.parameters()) if self.shared_experts is not None else []
        stored = [p for p in self.parameters(recurse=False)]
        if self.policy.moe_fused(x.shape[0], ids.numel(), x.dtype, x, weights, *stored, *others, int4=self.int4 is not None):
            shared = self._shared_in_place()
            parts = [fused_moe(x[t], w_gate_up, w_down, weights[t], ids[t], shared=shared,
                               direct_max_tokens=self.policy.moe_direct_max_tokens, pdl=self.policy.pdl)
                     for t in token_chunks(x.shape[0], ids.shape[1])]
            out = parts[0] if len(parts) == 1 else torch.cat(parts)  # one chunk (any 16-bit call): no copy
        else:
            out = grouped_moe(x, w_gate_up, w_down, weights, ids)
        if self.shared_experts is not None and shared is None:
            out = out + self.shared_experts(x)
        return out.view(shape)

    def _shared_in_place(self) -> SharedExperts | None:
        """The shared MLP's weights for fused_moe, which adds it inside its own launches; None (the
        MLP runs on its own) when there is none, or when its width is not a whole number of routed
        experts or its weights are not plain contiguous tensors of the model's dtype."""
        mlp = self.shared_experts
        if mlp is None or mlp.gate_proj.weight.shape[0] % self.inter:
            return None
        weights = (mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight)
        if any(not w.is_contiguous() or w.dtype != self.gate.weight.dtype for w in weights):
            return None
        return SharedExperts(*weights)
