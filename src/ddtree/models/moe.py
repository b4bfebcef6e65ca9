"""Dense SwiGLU MLP, the router (noaux_tc / greedy) and the routed + shared expert MoE."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels import use_kernel
from . import joint, skinny
from .config import TargetConfig
from .fused_moe import DTYPES as FUSED_DTYPES
from .fused_moe import ExpertRows, SharedExperts, fused_moe
from .moe_align import MAX_PAIRS
from .router_kernel import fused_route


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def fuse_input_projections(self) -> None:
        """gate_proj and up_proj in one buffer (joint.join): one GEMM reads the input."""
        joint.join(self.gate_proj, self.up_proj)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = joint.both(self.gate_proj, self.up_proj, x)
        return self.down_proj(F.silu(gate) * up)


def top_indices(x: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest values along the last dim, largest first, equal values by ascending
    index (a stable sort). torch.topk leaves tie order open: on the CPU it returned [4, 7, 5] for
    the top three of [1, 3, 3, 2, 3, 3, 0, 3]. The fused router (router_kernel.py) breaks ties so."""
    return x.sort(dim=-1, descending=True, stable=True).indices[..., :k].contiguous()


class Router(nn.Module):
    """Top-k expert choice per token: sigmoid scores with a correction bias and group limits
    (noaux_tc: DeepSeek-V3, Kimi K2, Moonlight) or softmax scores (greedy: DeepSeek-V2).

    After the float32 GEMM, two paths: PyTorch (the reference, autograd, the CPU default) and
    router_kernel.fused_route (one launch; CUDA without autograd by default). `fused` overrides
    the choice: None (automatic), True (the kernel, e.g. on the CPU under TRITON_INTERPRET=1) or
    False (PyTorch). Both give the same ids, ties included, and weights up to float32 rounding.
    """

    def __init__(self, cfg: TargetConfig):
        super().__init__()
        self.cfg = cfg
        self.weight = nn.Parameter(torch.empty(cfg.n_routed_experts, cfg.hidden_size))
        bias = cfg.topk_method == "noaux_tc"
        self.e_score_correction_bias = nn.Parameter(torch.zeros(cfg.n_routed_experts)) if bias else None
        self.fused: bool | None = None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, hidden] -> (weights float32 [T, k], expert ids int64 [T, k])."""
        if not use_kernel(self.fused, "Router.fused", x, self.weight):
            return self._reference(self._logits(x))
        cfg = self.cfg
        return fused_route(self._logits(x, skinny.linear), self.e_score_correction_bias, cfg.num_experts_per_tok,
                           scoring_func=cfg.scoring_func, topk_method=cfg.topk_method, n_group=cfg.n_group,
                           topk_group=cfg.topk_group, norm_topk_prob=cfg.norm_topk_prob,
                           routed_scaling_factor=cfg.routed_scaling_factor)

    def _logits(self, x: torch.Tensor, linear=None) -> torch.Tensor:
        """x [T, hidden] -> float32 [T, E]. On CUDA (or with `linear`, the kernel path's
        skinny.linear), 16-bit x and weight go through one GEMM with a float32 output: products of
        16-bit values are exact in float32, so it is the float32 GEMM up to summation order, without
        the two casting copies per layer (about half the router's time in the H200 profile)."""
        w = self.weight
        needs_grad = torch.is_grad_enabled() and (x.requires_grad or w.requires_grad)
        if x.dtype == w.dtype and x.dtype in (torch.bfloat16, torch.float16) and not needs_grad:
            if linear is not None:
                return linear(x, w, out_dtype=torch.float32)
            if x.is_cuda:
                return torch.mm(x, w.t(), out_dtype=torch.float32)
        return F.linear(x.float(), w.float())

    def _reference(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """logits float32 [T, E] -> (weights float32 [T, k], ids int64 [T, k])."""
        cfg = self.cfg
        scores = logits.sigmoid() if cfg.scoring_func == "sigmoid" else logits.softmax(-1)
        choice = scores if self.e_score_correction_bias is None else scores + self.e_score_correction_bias.float()
        if cfg.n_group > 1 and cfg.topk_method in ("noaux_tc", "group_limited_greedy"):
            grouped = choice.view(logits.shape[0], cfg.n_group, -1)
            group_score = grouped.topk(2, -1).values.sum(-1) if cfg.topk_method == "noaux_tc" else grouped.max(-1).values
            keep = torch.zeros_like(group_score).scatter_(1, top_indices(group_score, cfg.topk_group), 1.0)
            choice = choice.masked_fill(~keep.bool().repeat_interleave(grouped.shape[-1], 1), float("-inf"))
        ids = top_indices(choice, cfg.num_experts_per_tok)
        weights = scores.gather(1, ids)
        if cfg.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return weights * cfg.routed_scaling_factor, ids


# At or below this many tokens (and moe_align.MAX_PAIRS token-choice pairs) a CUDA forward runs the
# fused Triton kernels (fused_moe.py), above it the grouped GEMMs. On the H200 the fused path was
# faster at every count measured (benchmarks/results/moe_paths-nvidia-h200.md): 2.8x at 1 token,
# 1.7x at 65 and 1.25x at 520 (Moonlight's layer); 1.4x to 2.1x at 1 to 128 tokens and 1.23x at 520
# (Kimi K2's). In place, a budget-16 verify of 32 requests (544 rows) took 17.9 ms fused against
# 20.7 ms grouped for Moonlight and 30.1 against 37.5 for Kimi K2's 4 layers (engine_round runs of
# this day, before and after this bound was 520), so it covers 544; larger counts are unmeasured.
FUSED_MAX_TOKENS = 544
# Up to this many tokens MoE.forward(unsummed=True) leaves the sum over experts to the next norm:
# a decode step saves a launch per layer (H200, graphed `ar` round, interleaved replays: 2.349 ms
# with it, 2.370 without; benchmarks/results/decode_sweeps/). More rows keep the sum kernel, whose
# grid spreads the reads of their expert rows over more programs than one per row.
UNSUMMED_MAX_TOKENS = 16


class MoE(nn.Module):
    """Routed experts plus the shared experts. Two paths:

    - grouped: pairs sorted by expert for two grouped GEMMs (no per-token or per-expert Python
      loop, no host sync: expert offsets stay on the device). The reference, the path for more than
      FUSED_MAX_TOKENS rows (large batches of trees, long prefill chunks) and for autograd, and the
      CPU default, so training and CPU tests keep its numerics.
    - fused: the Triton kernels of fused_moe.py, which read each touched expert's weights once per
      block of its rows, and the shared experts' in the same launches. Taken on CUDA for at most
      FUSED_MAX_TOKENS tokens when no gradient is needed.

    `fused` overrides the choice: None (automatic), True (the fused path, e.g. on the CPU under
    TRITON_INTERPRET=1 in tests) or False (the grouped path).
    """

    def __init__(self, cfg: TargetConfig):
        super().__init__()
        e, h, i = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.gate = Router(cfg)
        self.w_gate_up = nn.Parameter(torch.empty(e, h, 2 * i))  # per expert [gate | up], transposed
        self.w_down = nn.Parameter(torch.empty(e, i, h))
        self.shared_experts = MLP(h, i * cfg.n_shared_experts) if cfg.n_shared_experts else None
        self.fused: bool | None = None

    def forward(self, x: torch.Tensor, router_ids: list[torch.Tensor] | None = None,
                unsummed: bool = False) -> torch.Tensor | ExpertRows:
        """x [..., hidden] -> [..., hidden]; router_ids, when a list, receives the expert ids
        int64 [tokens, k] this call routed to (the engine counts the experts a verify touched).
        unsummed: for at most UNSUMMED_MAX_TOKENS rows on the fused path, return fused_moe's
        ExpertRows (tokens = x's rows), whose sum the next RMSNorm computes itself; otherwise the
        tensor regardless."""
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        weights, ids = self.gate(x)
        if router_ids is not None:
            router_ids.append(ids)
        shared = None
        if self._use_fused(x, weights):
            shared = self._shared_in_place()
            if unsummed and x.shape[0] <= UNSUMMED_MAX_TOKENS and (shared is not None or self.shared_experts is None):
                return fused_moe(x, self.w_gate_up, self.w_down, weights, ids, shared=shared, unsummed=True)
            out = fused_moe(x, self.w_gate_up, self.w_down, weights, ids, shared=shared)
        else:
            out = self._grouped(x, weights, ids)
        if self.shared_experts is not None and shared is None:
            out = out + self.shared_experts(x)
        return out.view(shape)

    def _shared_in_place(self) -> SharedExperts | None:
        """The shared MLP's weights for fused_moe, which adds it inside its own launches; None (the
        MLP runs on its own) when there is none, or when its width is not a whole number of routed
        experts or its weights are not plain contiguous tensors of the experts' dtype."""
        mlp = self.shared_experts
        if mlp is None or mlp.gate_proj.weight.shape[0] % self.w_down.shape[1]:
            return None
        weights = (mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight)
        if any(not w.is_contiguous() or w.dtype != self.w_down.dtype for w in weights):
            return None
        return SharedExperts(*weights)

    def _use_fused(self, x: torch.Tensor, weights: torch.Tensor) -> bool:
        # The fused path reads the shared MLP's weights too: autograd on any of them keeps PyTorch.
        shared = self.shared_experts.parameters() if self.shared_experts is not None else ()
        chosen = use_kernel(self.fused, "MoE.fused", x, weights, self.w_gate_up, self.w_down, *shared)
        if self.fused is None:  # the automatic choice also wants few rows of a kernel dtype
            return (chosen and x.shape[0] <= FUSED_MAX_TOKENS and weights.numel() <= MAX_PAIRS
                    and x.dtype in FUSED_DTYPES)
        return chosen

    def _grouped(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """x [T, hidden], weights float32 [T, k], ids int64 [T, k] -> routed output [T, hidden]."""
        k = ids.shape[1]
        flat = ids.flatten()
        order = flat.argsort(stable=True)
        token = order // k
        counts = torch.zeros(self.w_down.shape[0], dtype=torch.int32, device=x.device)
        counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
        offsets = counts.cumsum(0, dtype=torch.int32)
        gate, up = torch._grouped_mm(x[token], self.w_gate_up, offs=offsets).chunk(2, dim=-1)
        routed = torch._grouped_mm(F.silu(gate) * up, self.w_down, offs=offsets)
        # Back to (token, choice) order and a float32 sum over the k choices: deterministic, unlike
        # an atomic index_add_, so a graph replay and an eager run give the same bits.
        per_choice = torch.empty_like(routed)
        per_choice[order] = routed
        return (per_choice.view(-1, k, routed.shape[-1]).float() * weights[..., None]).sum(1).to(x.dtype)
