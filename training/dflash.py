"""The DFlash training forward: many blocks per sequence in one non-causal pass.

For a sequence x_0 .. x_{T-1} with target features F_0 .. F_{T-1} and anchors a_1 .. a_K, block k
is [x_{a_k}, mask x (S - 1)] at positions a_k .. a_k + S - 1; it attends to the context
F_0 .. F_{a_k - 1} (what inference holds when x_{a_k} is the bonus token) and to its own S slots,
and slot j predicts x_{a_k + j}. This is exactly Drafter.draft_logits for each anchor taken alone
(tests/training checks it), computed for all K blocks at once with one attention mask.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ddtree.models import Drafter, Target
from ddtree.models.drafter import rotate_half


def block_inputs(ids: torch.Tensor, anchors: torch.Tensor, block_size: int, mask_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """ids int64 [B, T], anchors int64 [B, K] -> block tokens [B, K, S] ([x_a, mask, ...]) and
    their positions [B, K, S] (a .. a + S - 1)."""
    b, k = anchors.shape
    tokens = torch.full((b, k, block_size), mask_id, dtype=ids.dtype, device=ids.device)
    tokens[:, :, 0] = ids.gather(1, anchors)
    positions = anchors[..., None] + torch.arange(block_size, device=ids.device)
    return tokens, positions


def block_mask(anchors: torch.Tensor, seq_len: int, block_size: int) -> torch.Tensor:
    """bool [B, 1, K*S, T + K*S]: block k's queries see context keys j < a_k and their own block."""
    b, k = anchors.shape
    ctx = torch.arange(seq_len, device=anchors.device)[None, None, :] < anchors[..., None]  # [B, K, T]
    ctx = ctx.repeat_interleave(block_size, dim=1)  # [B, K*S, T]
    owner = torch.arange(k * block_size, device=anchors.device) // block_size
    own = owner[:, None] == owner[None, :]  # [K*S, K*S]
    return torch.cat([ctx, own.expand(b, -1, -1)], dim=-1)[:, None]


def draft_block_logits(drafter: Drafter, target: Target, ids: torch.Tensor, features: torch.Tensor,
                       anchors: torch.Tensor) -> torch.Tensor:
    """ids int64 [B, T]; features [B, T, len(target_layer_ids) * hidden] (the target's layer outputs
    for every token); anchors int64 [B, K] in [1, T - S]. Returns float32 logits [B, K, S - 1, vocab]:
    slot j of block k predicts x_{a_k + j}."""
    cfg = drafter.cfg
    s = cfg.block_size
    b, t = ids.shape
    k = anchors.shape[1]
    tokens, positions = block_inputs(ids, anchors, s, cfg.mask_token_id)
    positions = positions.view(b, k * s)
    x = target.embed_tokens(tokens.view(b, k * s))
    ctx = drafter.hidden_norm(drafter.fc(features.to(x.dtype)))
    ctx_pos = torch.arange(t, device=ids.device).expand(b, t)
    mask = block_mask(anchors, t, s)
    heads, kv_heads, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    for layer in drafter.layers:
        attn = layer.self_attn
        h = layer.input_layernorm(x)
        q = rotate_half(attn.q_norm(attn.q_proj(h).view(b, k * s, heads, d)), positions, cfg.rope_theta)
        k_ctx, v_ctx = attn.project_kv(ctx, ctx_pos)
        k_blk, v_blk = attn.project_kv(h, positions)
        keys = torch.cat([k_ctx, k_blk], dim=1).transpose(1, 2)
        values = torch.cat([v_ctx, v_blk], dim=1).transpose(1, 2)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), keys, values, attn_mask=mask, scale=d**-0.5,
                                             enable_gqa=kv_heads != heads)
        x = x + attn.o_proj(out.transpose(1, 2).reshape(b, k * s, -1))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    hidden = drafter.norm(x).view(b, k, s, -1)[:, :, 1:]
    return target.lm_head(hidden).float()


def position_weights(block_size: int, gamma: float, device=None) -> torch.Tensor:
    """DFlash's loss decay over the block: slot j (1-based) weighs exp(-(j - 1) / gamma). float32 [S - 1]."""
    return torch.exp(-torch.arange(block_size - 1, dtype=torch.float32, device=device) / gamma)


def distill_loss(logits: torch.Tensor, teacher_logits: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Position-weighted soft cross-entropy against the target's own next-token distributions.
    logits / teacher_logits float32 [B, K, S - 1, vocab]; weights [S - 1]. Returns a scalar."""
    teacher = teacher_logits.softmax(-1)
    ce = -(teacher * logits.log_softmax(-1)).sum(-1)  # [B, K, S - 1]
    return (ce * weights).sum(-1).mean() / weights.sum()


def teacher_for_blocks(target_logits: torch.Tensor, anchors: torch.Tensor, block_size: int) -> torch.Tensor:
    """target_logits [B, T, vocab] (position i predicts x_{i+1}) -> [B, K, S - 1, vocab]: for slot j
    of the block at a, the target's distribution over x_{a + j}, i.e. its logits at a + j - 1."""
    b, k = anchors.shape
    rows = anchors[..., None] + torch.arange(block_size - 1, device=anchors.device)  # a + j - 1, j = 1..S-1
    flat = rows.view(b, -1)
    picked = target_logits.gather(1, flat[..., None].expand(-1, -1, target_logits.shape[-1]))
    return picked.view(b, k, block_size - 1, -1)


def sample_anchors(batch: int, count: int, seq_len: int, block_size: int, generator: torch.Generator,
                   device=None) -> torch.Tensor:
    """count distinct anchors per sequence, uniform in [1, T - S], sorted. int64 [B, K]."""
    span = seq_len - block_size
    if count > span:
        raise ValueError(f"{count} anchors do not fit a window of {seq_len} tokens with blocks of {block_size}")
    scores = torch.rand(batch, span, generator=generator)
    return (scores.topk(count, dim=1).indices + 1).sort(dim=1).values.to(device)
