"""DFlash block-diffusion drafter (the DFlash checkpoint format: a Qwen3-style stack).

One non-causal pass over the block [bonus, mask x (block_size - 1)]: the block's queries attend to
keys/values of the target's features of every committed token (projected by fc + hidden_norm,
then by each layer's own k/v projections) and of the block itself. The context keys/values
depend only on the features, so each request keeps them in its own cache and a round only
projects the newly committed tokens. Embedding and lm_head are the target's.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from ..ops.drafter_qkv import drafter_qkv
from ..ops.gemm import linear as few_row_linear
from ..ops.launch import DTYPES as KERNEL_DTYPES
from ..ops.policy import KernelPolicy
from .drafter_config import DrafterConfig
from .layers import MLP, RMSNorm, apply_linear, join, joint_output, project, rotary_cos_sin, rotate


def _tables(positions: torch.Tensor, dim: int, theta: float, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float32, device=positions.device) / dim)
    return rotary_cos_sin(positions, inv_freq, 1.0, dtype)


def rope_tables(positions: torch.Tensor, cfg: DrafterConfig, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3's default rope: cos and sin [..., T, head_dim / 2] in dtype at positions [..., T]; a pass
    computes them once for all its layers."""
    return _tables(positions, cfg.head_dim, cfg.rope_theta, dtype)


def rotate_half(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Qwen3's default rope on x [B, T, heads, dim] at positions [B, T] (tables and rotation at once)."""
    return rotate(x, *_tables(positions, x.shape[-1], theta, x.dtype), interleave=False)


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

    def project_heads(self, linears: tuple[nn.Linear, ...], x: torch.Tensor, linear=F.linear
              ) -> tuple[list[torch.Tensor], torch.Tensor | None]:
        """The projections of x [B, T, hidden] as heads [B, T, H_i, head_dim] each, and all of them
        as one [B, T, sum H_i, head_dim] tensor when one GEMM made them (load_drafter joins the
        weights: layers.joint_output), else None."""
        b, t, d = *x.shape[:2], self.cfg.head_dim
        sizes = [m.weight.shape[0] // d for m in linears]
        joint = joint_output(linears, x, linear)
        if joint is None:
            return [apply_linear(m, x, linear).view(b, t, n, d) for m, n in zip(linears, sizes)], None
        joint = joint.view(b, t, sum(sizes), d)
        return list(joint.split(sizes, dim=-2)), joint

    def place(self, parts: list[torch.Tensor], joint: torch.Tensor | None, rope, k_cache: torch.Tensor,
              v_cache: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor) -> torch.Tensor | None:
        """parts (q, k, v) or (k, v) as project_heads(): returns q after q_norm and rope (None without q);
        k after k_norm and rope, and v, go into the caches at rows, slots (int64 [B, S]). One
        launch (ops/drafter_qkv.py) on the kernel path from joint, project_heads()' single GEMM output;
        else the layers op by op."""
        q, k, v = parts if len(parts) == 3 else (None, *parts)
        policy = self.k_norm.policy
        same = (self.q_norm.weight, self.k_norm.weight, *rope)
        kernel_dtypes = k.dtype in KERNEL_DTYPES and k_cache.dtype in KERNEL_DTYPES and all(t.dtype == k.dtype for t in same)
        if joint is not None and policy.kernel("RMSNorm", k, self.k_norm.weight) and (not policy.automatic or kernel_dtypes):
            return drafter_qkv(joint, 0 if q is None else q.shape[-2], (self.q_norm.weight, self.k_norm.weight), *rope,
                               self.k_norm.eps, k_cache, v_cache, rows, slots, pdl=policy.pdl)
        k_cache[rows, slots] = rotate(self.k_norm(k), *rope, interleave=False).to(k_cache.dtype)
        v_cache[rows, slots] = v.to(v_cache.dtype)
        return None if q is None else rotate(self.q_norm(q), *rope, interleave=False)

    def forward(self, x: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block: "BlockPass") -> torch.Tensor:
        """Block x [B, S, hidden] attends, non-causally, to its requests' context entries in
        k_cache / v_cache [B, capacity, kv_heads, head_dim] and to itself (block: what the pass's
        layers share).

        The block's own keys and values are written into the cache right after the context
        (block.rows, block.slots: which the next append_context overwrites), so attention reads
        the cache in place: nothing is concatenated.
        """
        cfg = self.cfg
        b, s, _ = x.shape
        heads, kv_heads, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        parts, joint = self.project_heads((self.q_proj, self.k_proj, self.v_proj), x, block.linear)
        q = self.place(parts, joint, block.rope, k_cache, v_cache, block.rows, block.slots)
        k, v = k_cache[:, : block.limit].transpose(1, 2), v_cache[:, : block.limit].transpose(1, 2)  # views, no copy
        # Grouped heads without repeating the keys: which keys a query sees does not depend on the
        # query (non-causal), so the query heads of one key head are rows of one attention
        group = heads // kv_heads
        q = q.view(b, s, kv_heads, group, d).permute(0, 2, 3, 1, 4).reshape(b, kv_heads, group * s, d)
        out = F.scaled_dot_product_attention(q, k.to(q.dtype), v.to(q.dtype), attn_mask=block.seen, scale=d**-0.5)
        out = out.view(b, kv_heads, group, s, d).permute(0, 3, 1, 2, 4).reshape(b, s, heads * d)
        return apply_linear(self.o_proj, out, block.linear)


@dataclass
class BlockPass:
    """What every layer of one draft pass shares, computed once a pass."""

    rope: tuple[torch.Tensor, torch.Tensor]  # cos, sin [B, S, head_dim / 2] at the block's positions
    rows: torch.Tensor  # int64 [B, S]: the cache row of each block token's key and value
    slots: torch.Tensor  # int64 [B, S]: its slot, right after the request's context
    limit: int  # keys read per request (the key_limit bound, or the whole capacity)
    seen: torch.Tensor  # bool [B, 1, 1, limit]: the keys each request's queries see (context + block)
    linear: object  # the GEMM, linear(x, weight) (Drafter._linear)


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
        row_index = rows[:, None].expand(b, c).contiguous()  # the kernel's layout, once for every layer
        for layer, k_cache, v_cache in zip(self.layers, cache.keys, cache.values):
            attn = layer.self_attn
            parts, joint = attn.project_heads((attn.k_proj, attn.v_proj), ctx, linear)
            attn.place(parts, joint, rope, k_cache, v_cache, row_index, slots)
        cache.lengths.index_add_(0, rows, counts.long())

    def forward(self, block_embeds: torch.Tensor, cache: DrafterCache, key_limit: int | None = None) -> torch.Tensor:
        """block_embeds [B, block_size, hidden]: the target's embeddings of [bonus, mask, ...];
        the block sits at positions next_positions() .. + block_size - 1 (entries lengths ..).
        Returns the normed hidden
        states of the block [B, block_size, hidden]; slots 1.. predict the next block_size - 1 tokens.
        The cache needs block_size free slots past each request's context (DrafterAttention.forward);
        key_limit: optional bound on max(lengths) + block_size, to read fewer keys (None: the
        whole capacity)."""
        b, s = block_embeds.shape[:2]
        device = block_embeds.device
        positions = cache.next_positions()[:, None] + torch.arange(s, device=device)
        limit = cache.keys[0].shape[1] if key_limit is None else key_limit
        block = BlockPass(rope=rope_tables(positions, self.cfg, block_embeds.dtype),
                          rows=torch.arange(b, device=device)[:, None].expand(b, s).contiguous(),  # no copy a layer
                          slots=cache.lengths[:, None] + torch.arange(s, device=device), limit=limit,
                          seen=(torch.arange(limit, device=device) < (cache.lengths + s)[:, None])[:, None, None, :],
                          linear=self._linear(block_embeds))
        x, h = block_embeds, self.layers[0].input_layernorm(block_embeds)
        norms = [layer.input_layernorm for layer in self.layers[1:]] + [self.norm]
        for layer, k_cache, v_cache, next_norm in zip(self.layers, cache.keys, cache.values, norms):
            x, h = layer.post_attention_layernorm(x, layer.self_attn(h, k_cache, v_cache, block))
            x, h = next_norm(x, layer.mlp(h, block.linear))  # each residual add in its norm's launch
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
        logits = target.logits_of(rows, float32=False)
        return logits.view(bonus.shape[0], self.cfg.block_size - 1, logits.shape[-1])
