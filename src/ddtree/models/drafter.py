"""DFlash block-diffusion drafter (the DFlash checkpoint format: a Qwen3-style stack).

One non-causal pass over the block [bonus, mask x (block_size - 1)]: the block's queries attend to
keys/values of the target's features of every committed token (projected by fc + hidden_norm,
then by each layer's own k/v projections) and of the block itself. The context keys/values
depend only on the features, so each request keeps them in its own cache and a round only
projects the newly committed tokens. Embedding and lm_head are the target's.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ..ops.gemm import linear as few_row_linear
from ..ops.launch import DTYPES as KERNEL_DTYPES
from ..ops.policy import KernelPolicy
from ..ops.drafter_qkv import drafter_qkv
from .config import from_config_file
from .layers import MLP, RMSNorm, apply_linear, join, project, rotary_cos_sin, rotate


def reference_layer_ids(target_layers: int, draft_layers: int) -> list[int]:
    """DFlash's reference choice of target layers when a drafter's config names none (its
    build_target_layer_ids): one per draft layer, evenly from layer 1 to layer target_layers - 3
    (Kimi K2.5 / K2.6, 61 layers, 6 draft layers: [1, 12, 24, 35, 47, 58])."""
    if draft_layers == 1:
        return [target_layers // 2]
    start, end = 1, target_layers - 3
    return [int(round(start + i * (end - start) / (draft_layers - 1))) for i in range(draft_layers)]


@dataclass(frozen=True)
class DrafterConfig:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    vocab_size: int
    attention_bias: bool
    # dflash_config
    target_layer_ids: tuple[int, ...]  # () when config.json leaves them to DFlash's rule (for_target)
    block_size: int
    mask_token_id: int

    def for_target(self, target_cfg) -> "DrafterConfig":
        """This config with its target layers settled for `target_cfg`: as given, or by DFlash's
        reference rule when config.json gives none (reference_layer_ids)."""
        if self.target_layer_ids:
            return self
        ids = reference_layer_ids(target_cfg.num_hidden_layers, self.num_hidden_layers)
        return dataclasses.replace(self, target_layer_ids=tuple(ids))

    @classmethod
    def from_dict(cls, raw: dict) -> "DrafterConfig":
        dflash = raw.get("dflash_config") or {}
        layer_ids = dflash.get("target_layer_ids", raw.get("target_layer_ids")) or ()
        mask = dflash.get("mask_token_id", raw.get("mask_token_id"))
        if mask is None:
            raise ValueError("drafter config.json lacks dflash_config.mask_token_id")
        if (raw.get("rope_scaling") or {}).get("rope_type", "default") not in ("default", None):
            raise NotImplementedError(f"drafter rope_scaling {raw['rope_scaling']} is not supported yet")
        unsupported = {k: raw.get(k, dflash.get(k)) for k in ("output_multiplier", "final_logit_softcapping", "input_embedding_scale")}
        unsupported = {k: v for k, v in unsupported.items() if v not in (None, 1, 1.0, 0, 0.0)}
        causal = raw.get("is_causal") or any(t != "full_attention" for t in raw.get("layer_types") or [])
        if unsupported or causal:
            raise NotImplementedError(
                f"drafter variant not supported yet: {unsupported or 'causal / sliding-window layers'}"
            )
        heads = raw["num_attention_heads"]
        return cls(
            hidden_size=raw["hidden_size"], intermediate_size=raw["intermediate_size"],
            num_hidden_layers=raw["num_hidden_layers"], num_attention_heads=heads,
            num_key_value_heads=raw.get("num_key_value_heads", heads),
            head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6), rope_theta=raw.get("rope_theta", 1e6),
            vocab_size=raw["vocab_size"], attention_bias=raw.get("attention_bias", False),
            target_layer_ids=tuple(layer_ids), block_size=int(dflash.get("block_size", raw.get("block_size", 16))),
            mask_token_id=int(mask),
        )

    @classmethod
    def from_pretrained(cls, path: str | Path) -> "DrafterConfig":
        return from_config_file(path, cls.from_dict, "a DFlash drafter's config")


def rope_tables(positions: torch.Tensor, cfg: DrafterConfig, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3's default rope: cos and sin [..., T, head_dim / 2] in dtype at positions [..., T]; a pass
    computes them once for all its layers."""
    dim = cfg.head_dim
    inv_freq = 1.0 / cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float32, device=positions.device) / dim)
    return rotary_cos_sin(positions, inv_freq, 1.0, dtype)


def rotate_half(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Qwen3's default rope on x [B, T, heads, dim] at positions [B, T] (tables and rotation at once)."""
    dim = x.shape[-1]
    inv_freq = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float32, device=x.device) / dim)
    return rotate(x, *rotary_cos_sin(positions, inv_freq, 1.0, x.dtype), interleave=False)


@dataclass
class DrafterCache:
    """Per layer, the context keys and values [B, capacity, kv_heads, head_dim]; lengths int64 [B]
    (entries held). skipped: optional int64 [B], committed tokens the context left out (a plain
    step of budget="auto" may leave its row out): the next entry's position is lengths + skipped,
    so every key keeps its token's true position and a gap is only keys not there."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    lengths: torch.Tensor
    skipped: torch.Tensor | None = None

    def next_positions(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """int64 [B] (or [len(rows)]): the sequence position of each slot's next entry."""
        lengths = self.lengths if rows is None else self.lengths[rows]
        if self.skipped is None:
            return lengths
        return lengths + (self.skipped if rows is None else self.skipped[rows])


class DrafterAttention(nn.Module):
    def __init__(self, cfg: DrafterConfig, policy: KernelPolicy = KernelPolicy()):
        super().__init__()
        self.cfg = cfg
        h, d, bias = cfg.hidden_size, cfg.head_dim, cfg.attention_bias
        self.q_proj = nn.Linear(h, cfg.num_attention_heads * d, bias=bias)
        self.k_proj = nn.Linear(h, cfg.num_key_value_heads * d, bias=bias)
        self.v_proj = nn.Linear(h, cfg.num_key_value_heads * d, bias=bias)
        self.o_proj = nn.Linear(cfg.num_attention_heads * d, h, bias=bias)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps, policy)
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps, policy)

    def project_kv(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, T, hidden] -> rotated keys and values [B, T, kv_heads, head_dim] at positions [B, T]
        (the PyTorch path, which training differentiates)."""
        shape = (*x.shape[:2], self.cfg.num_key_value_heads, self.cfg.head_dim)
        k, v = project((self.k_proj, self.v_proj), x)
        return rotate(self.k_norm(k.view(shape)), *rope_tables(positions, self.cfg, x.dtype), interleave=False), v.view(shape)

    def place(self, q: torch.Tensor | None, k: torch.Tensor, v: torch.Tensor, rope, k_cache: torch.Tensor,
              v_cache: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor) -> torch.Tensor | None:
        """q [B, S, heads, d] (or None), k and v [B, S, kv_heads, d]: returns q after q_norm and
        rope; k after k_norm and rope, and v, go into the caches at rows, slots (int64 [B, S]).
        One launch (ops/drafter_qkv.py) on the kernel path when they are adjacent columns of one
        GEMM's output (load_drafter joins the projections); else the layers op by op."""
        policy = self.k_norm.policy
        joint = _adjacent([t for t in (q, k, v) if t is not None])
        kernel_dtypes = k.dtype in KERNEL_DTYPES and k_cache.dtype in KERNEL_DTYPES
        if joint is not None and policy.kernel("RMSNorm", k, self.k_norm.weight) and (not policy.automatic or kernel_dtypes):
            return drafter_qkv(joint, 0 if q is None else q.shape[-2], (self.q_norm.weight, self.k_norm.weight), *rope,
                               self.k_norm.eps, k_cache, v_cache, rows, slots, pdl=policy.pdl)
        k_cache[rows, slots] = rotate(self.k_norm(k), *rope, interleave=False).to(k_cache.dtype)
        v_cache[rows, slots] = v.to(v_cache.dtype)
        return None if q is None else rotate(self.q_norm(q), *rope, interleave=False)

    def forward(self, x, rope, k_cache, v_cache, ctx_len, key_limit: int | None = None, linear=F.linear,
                entries: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """Block x [B, S, hidden], rotated by rope (rope_tables at its positions [B, S]), attends,
        non-causally, to the first ctx_len [B] context entries of k_cache / v_cache
        [B, capacity, kv_heads, head_dim] and to itself. `linear(x, weight)` computes the
        projections (layers.project).

        The block's own keys and values are written into the cache right after the context
        (slots ctx_len .. ctx_len + S - 1, which the next append_context overwrites; entries: those
        (rows, slots), int64 [B, S] each, when the caller has them), so attention reads the cache
        in place: nothing is concatenated. key_limit (>= max(ctx_len) + S, a bound the caller
        knows) trims the keys read; None reads the whole capacity.
        """
        cfg = self.cfg
        b, s, _ = x.shape
        heads, kv_heads, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        rows, slots = entries or block_entries(ctx_len, s)
        q, k_blk, v_blk = project((self.q_proj, self.k_proj, self.v_proj), x, linear)
        q = self.place(q.view(b, s, heads, d), k_blk.view(b, s, kv_heads, d), v_blk.view(b, s, kv_heads, d), rope,
                       k_cache, v_cache, rows, slots)
        limit = k_cache.shape[1] if key_limit is None else key_limit
        k, v = k_cache[:, :limit].transpose(1, 2), v_cache[:, :limit].transpose(1, 2)  # views, no copy
        seen = torch.arange(limit, device=x.device)[None, :] < (ctx_len + s)[:, None]  # context + whole block
        # Grouped heads without repeating the keys: which keys a query sees does not depend on the
        # query (non-causal), so the query heads of one key head are rows of one attention
        group = heads // kv_heads
        q = q.view(b, s, kv_heads, group, d).permute(0, 2, 3, 1, 4).reshape(b, kv_heads, group * s, d)
        out = F.scaled_dot_product_attention(q, k.to(q.dtype), v.to(q.dtype), attn_mask=seen[:, None, None, :],
                                             scale=d**-0.5)
        out = out.view(b, kv_heads, group, s, d).permute(0, 3, 1, 2, 4).reshape(b, s, heads * d)
        return apply_linear(self.o_proj, out, linear)


def block_entries(ctx_len: torch.Tensor, s: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, slots) int64 [B, S]: the cache entries of a block of S after ctx_len [B] entries."""
    b = ctx_len.shape[0]
    rows = torch.arange(b, device=ctx_len.device)[:, None].expand(b, s)
    return rows, ctx_len[:, None] + torch.arange(s, device=ctx_len.device)


def _adjacent(parts: list[torch.Tensor]) -> torch.Tensor | None:
    """Tensors [..., H_i, d] as one [..., sum H_i, d] view when each one's heads follow the one
    before's in memory with the same strides (split columns of one GEMM's output), else None."""
    first = parts[0]
    for a, b in zip(parts, parts[1:]):
        if b.stride() != first.stride() or b.dtype != first.dtype or b.shape[:-2] != first.shape[:-2] or b.shape[-1] != first.shape[-1]:
            return None
        if b.data_ptr() != a.data_ptr() + a.shape[-2] * a.stride(-2) * a.element_size():
            return None
    heads = sum(t.shape[-2] for t in parts)
    return first.as_strided((*first.shape[:-2], heads, first.shape[-1]), first.stride())


class DrafterLayer(nn.Module):
    def __init__(self, cfg: DrafterConfig, policy: KernelPolicy = KernelPolicy()):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, policy)
        self.self_attn = DrafterAttention(cfg, policy)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, policy)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)


class Drafter(nn.Module):
    """policy: its kernel policy (ops/policy.py): its norms' path and, on the kernel path, the
    few-row GEMM (ops/gemm.py) for passes of at most policy.gemm_max_rows rows."""

    def __init__(self, cfg: DrafterConfig, policy: KernelPolicy = KernelPolicy()):
        super().__init__()
        self.cfg = cfg
        self.policy = policy
        self.layers = nn.ModuleList(DrafterLayer(cfg, policy) for _ in range(cfg.num_hidden_layers))
        self.fc = nn.Linear(len(cfg.target_layer_ids) * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, policy)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, policy)

    def fuse_input_projections(self) -> None:
        """Every layer's q, k and v weights in one buffer and its MLP's gate and up in another
        (layers.join), so inference reads each input with one GEMM; load_drafter calls it before
        any weight is copied in."""
        for layer in self.layers:
            attn = layer.self_attn
            join(attn.q_proj, attn.k_proj, attn.v_proj)
            layer.mlp.fuse_input_projections()

    def _linear(self, x: torch.Tensor):
        """The GEMM for a pass over x: ops/gemm.linear on the kernel path (the few-row kernel up to
        policy.gemm_max_rows rows, cuBLAS above), else F.linear."""
        if not self.policy.kernel("drafter GEMM", x, self.fc.weight):
            return F.linear
        return partial(few_row_linear, max_rows=self.policy.gemm_max_rows, pdl=self.policy.pdl)

    def new_cache(self, batch: int, capacity: int, device=None, dtype=None) -> DrafterCache:
        w = self.fc.weight
        shape = (batch, capacity, self.cfg.num_key_value_heads, self.cfg.head_dim)
        make = lambda: [torch.zeros(shape, device=device or w.device, dtype=dtype or w.dtype) for _ in self.layers]  # noqa: E731
        return DrafterCache(make(), make(), torch.zeros(batch, dtype=torch.long, device=device or w.device))

    def append_context(self, cache: DrafterCache, features: torch.Tensor, counts: torch.Tensor, *, check: bool = True,
                       rows: torch.Tensor | None = None) -> None:
        """Project newly committed tokens' target features [B, C, len(target_layer_ids) * hidden]
        (the first counts[b] valid) into every layer's cache at entries lengths .. lengths + C - 1
        (sequence positions from cache.next_positions()).

        All C slots are written (static shapes, no data-dependent indexing): slots past
        lengths + counts hold garbage that attention never reads and the next append overwrites.
        rows: optional int64 [B], the cache rows (request slots) to append to; default 0 .. B - 1.
        check: verify lengths + C fits the cache capacity (a host sync; off inside CUDA graphs).
        """
        b, c, _ = features.shape
        rows = torch.arange(b, device=features.device) if rows is None else rows
        lengths = cache.lengths[rows]
        if check and int(lengths.max()) + c > cache.keys[0].shape[1]:
            raise ValueError(f"drafter cache capacity {cache.keys[0].shape[1]} exceeded")
        linear = self._linear(features)
        ctx = self.hidden_norm(apply_linear(self.fc, features, linear))
        steps = torch.arange(c, device=features.device)
        slots, positions = lengths[:, None] + steps, cache.next_positions(rows)[:, None] + steps
        rope = rope_tables(positions, self.cfg, ctx.dtype)
        row_index = rows[:, None].expand(b, c)
        shape = (b, c, self.cfg.num_key_value_heads, self.cfg.head_dim)
        for layer, k_cache, v_cache in zip(self.layers, cache.keys, cache.values):
            attn = layer.self_attn
            k, v = project((attn.k_proj, attn.v_proj), ctx, linear)
            attn.place(None, k.view(shape), v.view(shape), rope, k_cache, v_cache, row_index, slots)
        cache.lengths.index_add_(0, rows, counts.long())

    def forward(self, block_embeds: torch.Tensor, cache: DrafterCache, key_limit: int | None = None) -> torch.Tensor:
        """block_embeds [B, block_size, hidden]: the target's embeddings of [bonus, mask, ...];
        the block sits at positions next_positions() .. + block_size - 1 (entries lengths ..).
        Returns the normed hidden
        states of the block [B, block_size, hidden]; slots 1.. predict the next block_size - 1 tokens.
        The cache needs block_size free slots past each request's context (DrafterAttention.forward);
        key_limit: optional bound on max(lengths) + block_size, to read fewer keys."""
        positions = cache.next_positions()[:, None] + torch.arange(block_embeds.shape[1], device=block_embeds.device)
        rope = rope_tables(positions, self.cfg, block_embeds.dtype)
        linear = self._linear(block_embeds)
        entries = block_entries(cache.lengths, block_embeds.shape[1])
        x, h = block_embeds, self.layers[0].input_layernorm(block_embeds)
        norms = [layer.input_layernorm for layer in self.layers[1:]] + [self.norm]
        for layer, k_cache, v_cache, next_norm in zip(self.layers, cache.keys, cache.values, norms):
            attn = layer.self_attn(h, rope, k_cache, v_cache, cache.lengths, key_limit, linear, entries)
            x, h = layer.post_attention_layernorm(x, attn)
            x, h = next_norm(x, layer.mlp(h, linear))  # each residual add in its norm's launch
        return h

    def draft_logits(self, target, bonus: torch.Tensor, cache: DrafterCache, key_limit: int | None = None) -> torch.Tensor:
        """bonus int64 [B] (each request's carried-over token) -> logits [B, block_size - 1, vocab] in
        the target's lm_head dtype (what top-k reads: no float32 copy): the block [bonus,
        mask x (block_size - 1)] embedded by the target, the bonus in slot 0, and the target's
        lm_head over slots 1.., which predict the next block_size - 1 tokens."""
        block = torch.full((bonus.shape[0], self.cfg.block_size), self.cfg.mask_token_id, dtype=torch.long, device=bonus.device)
        block[:, 0] = bonus
        hidden = self(target.embed(block), cache, key_limit)
        # As rows of one GEMM: cuBLAS took the strided [B, S - 1, hidden] slice as B batched GEMMs that
        # each read the whole lm_head (B times its bytes: benchmarks/results/profile_round-*-b32-*)
        rows = hidden[:, 1:].reshape(-1, hidden.shape[-1])
        return target.logits_of(rows, float32=False).view(bonus.shape[0], self.cfg.block_size - 1, -1)


def check_pair(target_cfg, drafter_cfg: DrafterConfig) -> None:
    """A drafter shares the target's embedding and lm_head and reads its layers' outputs: refuse a
    mismatched pair before any compute."""
    if drafter_cfg.hidden_size != target_cfg.hidden_size:
        raise ValueError(f"drafter hidden_size {drafter_cfg.hidden_size} != target hidden_size {target_cfg.hidden_size}")
    if drafter_cfg.vocab_size != target_cfg.vocab_size:
        raise ValueError(f"drafter vocab_size {drafter_cfg.vocab_size} != target vocab_size {target_cfg.vocab_size}")
    ids = list(drafter_cfg.target_layer_ids)
    if not ids:
        raise ValueError("drafter target_layer_ids is empty")
    if ids != sorted(set(ids)):
        # Features are concatenated in this order and fc was trained on it: a repeat or a swap
        # would feed the drafter the wrong layers without any shape error.
        raise ValueError(f"drafter target_layer_ids {ids} must be strictly increasing (no repeats)")
    bad = [i for i in ids if not 0 <= i < target_cfg.num_hidden_layers]
    if bad:
        raise ValueError(f"drafter target_layer_ids {bad} out of range for a {target_cfg.num_hidden_layers}-layer target")
    if not 0 <= drafter_cfg.mask_token_id < target_cfg.vocab_size:
        raise ValueError(f"drafter mask_token_id {drafter_cfg.mask_token_id} is not in the vocabulary")
