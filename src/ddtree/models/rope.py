"""Rotary embedding with DeepSeek's YaRN scaling, and MLA's softmax scale."""

from __future__ import annotations

import math

import torch

from .config import TargetConfig


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
