"""A decode step's decoder layer with both RMSNorms inside the GEMMs that read them.

DecoderLayer.forward_paged takes this path for at most skinny.MAX_ROWS rows of a verify / decode
forward when its norms and MLA run their kernels: the input norm runs in the prologue of the joint
q / kv_a projection, the post-attention norm in the router's (normed_linear.py), which also stores
the normalized rows for the experts. Two launches fewer per layer; the results are the kernel
path's up to the order of the norm's sum of squares (tests/models/test_fused_target.py).
"""

from __future__ import annotations

import torch

from . import joint, skinny
from .moe import MoE
from .normed_linear import normed_linear
from .paged import ForwardMeta

MAX_ROWS = skinny.MAX_ROWS  # rows of a forward that take this path (0: never)


def eligible(layer, x: torch.Tensor, delta: torch.Tensor | None, meta) -> bool:
    """Whether `layer` (a DecoderLayer) can run forward() on input x [B, N, hidden] + delta."""
    if not isinstance(meta, ForwardMeta) or x.shape[0] * x.shape[1] > min(MAX_ROWS, skinny.MAX_ROWS):
        return False
    attn = layer.self_attn
    if not attn.uses_kernels(x) or joint.joint_weight(*attn._input_projections()) is None:
        return False
    if delta is not None and delta.dtype != x.dtype:
        return False
    norms = (layer.input_layernorm, layer.post_attention_layernorm)
    return all(norm._use_kernel(x, None) and norm.weight.dtype == x.dtype for norm in norms)


def forward(layer, x: torch.Tensor, delta: torch.Tensor | None, meta: ForwardMeta, cache: torch.Tensor,
            rope: tuple[torch.Tensor, torch.Tensor], router_ids: list[torch.Tensor] | None = None
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """DecoderLayer.forward_paged's contract: input x + delta [B, N, hidden] (delta None for the
    first layer); returns (residual, mlp_out) [B, N, hidden], whose sum is the layer's output."""
    b, n, hidden = x.shape
    attn, cfg = layer.self_attn, layer.self_attn.cfg
    first, second = attn._input_projections()
    flat = x.reshape(-1, hidden)
    ln = layer.input_layernorm
    qkv, total, _ = normed_linear(flat, None if delta is None else delta.reshape(-1, hidden), ln.weight, ln.eps,
                                  joint.joint_weight(first, second))
    residual = flat if total is None else total
    q, kv = qkv.split([first.weight.shape[0], second.weight.shape[0]], dim=-1)
    if cfg.q_lora_rank is not None:
        q = skinny.linear(attn.q_a_layernorm(q), attn.q_b_proj.weight)
    q = q.view(b, n, cfg.num_attention_heads, cfg.qk_head_dim)
    attn_out = attn.attend_projected(q, kv.view(b, n, -1), meta, cache, rope).reshape(-1, hidden)
    ln, mlp = layer.post_attention_layernorm, layer.mlp
    if isinstance(mlp, MoE) and mlp.gate.uses_kernels(residual) and mlp.gate.weight.dtype == x.dtype:
        logits, residual, h = normed_linear(residual, attn_out, ln.weight, ln.eps, mlp.gate.weight,
                                            out_dtype=torch.float32, want_h=True)
        out = mlp(h, router_ids, logits=logits)
    else:
        residual, h = ln(residual, attn_out)
        out = mlp(h, router_ids) if isinstance(mlp, MoE) else mlp(h)
    return residual.view(b, n, hidden), out.view(b, n, hidden)
