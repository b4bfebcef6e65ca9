"""The MLA + MoE target (DeepSeek-V3 / Kimi K2 family) in PyTorch.

`forward` is a plain causal prefill: MLA expands the latent into per-head keys and values with
kv_b_proj. `forward_paged` runs over the paged latent cache in one of two forms, chosen by its
metadata: with a ForwardMeta the verify / decode form (kv_b_proj absorbed into the query and the
output, models/paged.py), with a PrefillMeta the prefill of a prompt chunk (the latents expanded
like `forward` does, causal SDPA over the request's pages, models/paged.py).

Every layer with a kernel beside its PyTorch reference (the norms, MLA's paged forward, the
router, the MoE) holds the model's KernelPolicy (ops/policy.py), chosen when the model is built
or loaded. Few launches per layer on CUDA: rotary cos/sin once per forward, both input
projections in one GEMM, the residual adds inside the norms, MLA's cache entry and query rope as
kernels (ops/mla.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..ops.gemm import linear as few_row_linear
from ..ops.policy import KernelPolicy
from ..parallel.shard import SINGLE, Shard
from .config import TargetConfig
from .layers import MLP, MoE, RMSNorm, both, inv_freq_and_factor, join, rotary_cos_sin, rotate, softmax_scale
from .paged import ForwardMeta, PrefillMeta, absorbed_attention, attend, gather_entries, write_entries


class MLA(nn.Module):
    """Multi-head latent attention. Per token the cache keeps the normalized latent
    [kv_lora_rank] and the rotated shared key [qk_rope_head_dim].

    `rope` arguments are (cos, sin) [B, T, qk_rope_head_dim / 2] (layers.rotary_cos_sin), computed
    once per forward. The policy picks forward_paged's path: ops/mla.py's kernels, the few-row
    GEMM and the tree-verify kernel, or the PyTorch reference.
    """

    def __init__(self, cfg: TargetConfig, policy: KernelPolicy = KernelPolicy(), shard: Shard = SINGLE):
        super().__init__()
        self.cfg = cfg
        self.policy = policy
        self.shard = shard
        h = cfg.hidden_size
        mine = shard.part(cfg.num_attention_heads, "attention heads")
        self.heads = heads = mine.stop - mine.start  # this rank's heads; the latent cache stays whole
        if cfg.q_lora_rank is None:
            self.q_proj = nn.Linear(h, heads * cfg.qk_head_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(h, cfg.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps, policy)
            self.q_b_proj = nn.Linear(cfg.q_lora_rank, heads * cfg.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(h, cfg.kv_lora_rank + cfg.qk_rope_head_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, cfg.rms_norm_eps, policy)
        self.kv_b_proj = nn.Linear(cfg.kv_lora_rank, heads * (cfg.qk_nope_head_dim + cfg.v_head_dim), bias=False)
        self.o_proj = nn.Linear(heads * cfg.v_head_dim, h, bias=False)
        self.scale = softmax_scale(cfg)

    def _input_projections(self) -> tuple[nn.Linear, nn.Linear]:
        """The two projections that read the layer's input: the query's first, the latent's."""
        return self.q_proj if self.cfg.q_lora_rank is None else self.q_a_proj, self.kv_a_proj_with_mqa

    def fuse_input_projections(self) -> None:
        """Both input projections in one buffer (layers.join), so a forward reads the input with
        one GEMM. The loader calls it."""
        join(*self._input_projections())

    def project(self, x: torch.Tensor, linear=F.linear) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, T, hidden] -> q [B, T, H, qk_head_dim] (not rotated), kv [B, T, kv_lora_rank + rope]
        (latent before its norm, shared key before rotation). `linear(x, weight)` runs the GEMMs."""
        cfg = self.cfg
        q, kv = both(*self._input_projections(), x, linear)
        if cfg.q_lora_rank is not None:
            q = linear(self.q_a_layernorm(q), self.q_b_proj.weight)
        return q.view(*x.shape[:2], self.heads, cfg.qk_head_dim), kv

    def rotated(self, q: torch.Tensor, kv: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]):
        """PyTorch path: project's outputs -> q_nope [B, T, H, nope], q_rope [B, T, H, rope]
        (rotated) and cache entries [B, T, kv_lora_rank + rope] (normalized latent, rotated key)."""
        cfg = self.cfg
        q_nope, q_rope = q.split([cfg.qk_nope_head_dim, cfg.qk_rope_head_dim], dim=-1)
        latent, k_rope = kv.split([cfg.kv_lora_rank, cfg.qk_rope_head_dim], dim=-1)
        k_rope = rotate(k_rope[:, :, None], *rope, cfg.rope_interleave)[:, :, 0]
        entries = torch.cat([self.kv_a_layernorm(latent), k_rope], dim=-1)
        return q_nope, rotate(q_rope, *rope, cfg.rope_interleave), entries

    def expanded_attention(self, q_nope: torch.Tensor, q_rope: torch.Tensor, entries: torch.Tensor,
                           attn_mask=None) -> torch.Tensor:
        """Non-absorbed form: cache entries [B, L, kv_lora_rank + rope] are expanded by kv_b_proj
        into per-head k_nope / v, the shared k_rope joins every head, and SDPA attends.

        q_nope [B, N, H, nope], q_rope [B, N, H, rope]; attn_mask None: causal with N == L, else
        any SDPA mask (PrefillMeta.attn_mask). Returns the o_proj output [B, N, hidden].
        """
        cfg = self.cfg
        b, n, heads, _ = q_nope.shape
        latent, k_rope = entries.split([cfg.kv_lora_rank, cfg.qk_rope_head_dim], dim=-1)
        kv = self.kv_b_proj(latent).view(b, entries.shape[1], heads, -1)
        k_nope, v = kv.split([cfg.qk_nope_head_dim, cfg.v_head_dim], dim=-1)
        q = torch.cat([q_nope, q_rope], -1).transpose(1, 2)  # [B, H, N, qk]
        k = torch.cat([k_nope, k_rope[:, :, None].expand(-1, -1, heads, -1)], -1).transpose(1, 2)  # [B, H, L, qk]
        out = F.scaled_dot_product_attention(q, k, v.transpose(1, 2), attn_mask=attn_mask, is_causal=attn_mask is None,
                                             scale=self.scale)
        return self.shard.all_reduce(self.o_proj(out.transpose(1, 2).reshape(b, n, -1)))

    def forward_prefill(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """Causal attention over the sequence itself, plain (non-absorbed) form."""
        q_nope, q_rope, entries = self.rotated(*self.project(x), rope)
        return self.expanded_attention(q_nope, q_rope, entries)

    def forward_prefill_paged(self, x: torch.Tensor, meta: PrefillMeta, cache: torch.Tensor,
                              rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """Prompt chunk over the paged cache, non-absorbed form: writes the new entries (as
        forward_paged), reads each request's entries 0 .. prefix + N - 1 back, attends causally."""
        q_nope, q_rope, entries = self.rotated(*self.project(x), rope)
        write_entries(cache, entries, meta)
        return self.expanded_attention(q_nope, q_rope, gather_entries(cache, meta).to(x.dtype), meta.attn_mask)

    def absorbed_weight(self) -> torch.Tensor:
        """kv_b_proj's weight as [H, qk_nope + v, kv_lora_rank]: W_UK and W_UV per head."""
        cfg = self.cfg
        return self.kv_b_proj.weight.view(self.heads, cfg.qk_nope_head_dim + cfg.v_head_dim,
                                          cfg.kv_lora_rank)

    def uses_kernels(self, x: torch.Tensor) -> bool:
        """Whether forward_paged takes the kernel path for input x (the policy). The kernels read
        every projection's weight, so autograd on any of them keeps the PyTorch path."""
        return self.policy.kernel("MLA", x, *self.parameters())

    def _linear(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return few_row_linear(x, weight, max_rows=self.policy.gemm_max_rows, pdl=self.policy.pdl)

    def forward_paged(self, x: torch.Tensor, meta: ForwardMeta, cache: torch.Tensor,
                      rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """Absorbed form over the paged cache: writes the new entries, then attends (verify / decode)."""
        cfg = self.cfg
        b, n, _ = x.shape
        w = self.absorbed_weight()
        if self.uses_kernels(x):  # a decode step's GEMMs run the few-row kernel
            q, kv = self.project(x, self._linear)
            norm = (self.kv_a_layernorm.weight, self.kv_a_layernorm.eps)
            out = absorbed_attention(q, kv, w, norm, meta, cache, rope, self.scale, cfg.rope_interleave, self.policy)
            return self.shard.all_reduce(self._linear(out.view(b, n, -1), self.o_proj.weight))
        q, kv = self.project(x)
        q_nope, q_rope, entries = self.rotated(q, kv, rope)
        write_entries(cache, entries, meta)
        q_latent = torch.einsum("bnhk,hkc->bnhc", q_nope, w[:, : cfg.qk_nope_head_dim])  # W_UK absorbed
        out_latent = attend(torch.cat([q_latent, q_rope], -1), cache, meta, self.scale, cfg.kv_lora_rank)  # reference
        out = torch.einsum("bnhc,hvc->bnhv", out_latent.to(x.dtype), w[:, cfg.qk_nope_head_dim :])  # W_UV
        return self.shard.all_reduce(self.o_proj(out.reshape(b, n, -1)))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: TargetConfig, layer: int, policy: KernelPolicy = KernelPolicy(), shard: Shard = SINGLE):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, policy)
        self.self_attn = MLA(cfg, policy, shard)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, policy)
        self.mlp = (MoE(cfg, policy, shard) if cfg.is_moe_layer(layer)
                    else MLP(cfg.hidden_size, cfg.intermediate_size, shard))
        self.shard = shard

    def feed_forward(self, h: torch.Tensor, router_ids: list[torch.Tensor] | None = None) -> torch.Tensor:
        """The MLP or MoE of the normed input, its ranks' partial outputs summed."""
        return self.shard.all_reduce(self.mlp(h, router_ids) if isinstance(self.mlp, MoE) else self.mlp(h))

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x = x + self.self_attn.forward_prefill(self.input_layernorm(x), rope)
        return x + self.feed_forward(self.post_attention_layernorm(x))

    def forward_paged(self, x: torch.Tensor, delta: torch.Tensor | None, meta: ForwardMeta | PrefillMeta,
                      cache: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                      router_ids: list[torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's input is x + delta (delta: the previous layer's MLP output, None for the
        first), so that each residual add runs inside the norm after it. Returns (residual,
        mlp_out), [B, N, hidden] each; their sum is the layer's output."""
        attn = self.self_attn.forward_prefill_paged if isinstance(meta, PrefillMeta) else self.self_attn.forward_paged
        x, h = (x, self.input_layernorm(x)) if delta is None else self.input_layernorm(x, delta)
        x, h = self.post_attention_layernorm(x, attn(h, meta, cache, rope))
        return x, self.feed_forward(h, router_ids)


class Target(nn.Module):
    """Embedding, decoder layers, final norm, lm_head. policy: every layer's kernel policy; shard:
    the part of the model this process holds (parallel/shard.py; the embedding and lm_head by
    vocabulary rows: embed() and logits_of() join the ranks' parts)."""

    def __init__(self, cfg: TargetConfig, policy: KernelPolicy = KernelPolicy(), shard: Shard = SINGLE):
        super().__init__()
        self.cfg = cfg
        self.shard = shard
        self.vocab_rows = shard.part(cfg.vocab_size, "vocab_size")
        vocab = self.vocab_rows.stop - self.vocab_rows.start
        self.embed_tokens = nn.Embedding(vocab, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, policy, shard) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, policy)
        self.lm_head = nn.Linear(cfg.hidden_size, vocab, bias=False)
        inv_freq, factor = inv_freq_and_factor(cfg)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.rope_factor = factor

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings [..., hidden] of ids [...]: each rank looks up its vocabulary rows."""
        if self.shard.world == 1:
            return self.embed_tokens(ids)
        local = ids - self.vocab_rows.start
        mine = (local >= 0) & (local < self.embed_tokens.num_embeddings)
        rows = self.embed_tokens(torch.where(mine, local, 0)) * mine[..., None]
        return self.shard.all_reduce(rows)

    def logits_of(self, hidden: torch.Tensor, float32: bool = True) -> torch.Tensor:
        """Logits [..., vocab] of normed hidden states [..., hidden], the ranks' vocabulary rows
        gathered: float32, or (float32=False) lm_head's own dtype, whose float32 copy holds the same
        values."""
        logits = self.lm_head(hidden)
        return self.shard.all_gather(logits.float() if float32 else logits)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor | None = None, hidden_layers: tuple[int, ...] = ()
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Causal prefill. input_ids int64 [B, T]; positions int64 [B, T] (default 0..T-1).

        Returns logits float32 [B, T, vocab] and the outputs of the decoder layers named in
        hidden_layers ([B, T, hidden] each; layer i's output is transformers' hidden_states[i + 1]).
        """
        if positions is None:
            positions = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
        x = self.embed(input_ids)
        rope = rotary_cos_sin(positions, self.inv_freq, self.rope_factor, x.dtype)
        captured = []
        for i, layer in enumerate(self.layers):
            x = layer(x, rope)
            if i in hidden_layers:
                captured.append(x)
        return self.logits_of(self.norm(x)), captured

    def new_cache(self, num_pages: int, page_size: int = 64, device=None, dtype=None) -> list[torch.Tensor]:
        """One paged latent cache per layer: [num_pages + 1, page_size, kv_lora_rank + qk_rope_head_dim],
        views of one tensor (so that one launch reaches every layer's: ops/cache_moves.py).

        Pages 0 .. num_pages - 1 are for requests; page num_pages (the last) is the scratch page
        that padding rows write to (ForwardMeta.build's scratch_page) and that no request owns.
        """
        dtype = dtype or self.embed_tokens.weight.dtype
        device = device or self.embed_tokens.weight.device
        width = self.cfg.kv_lora_rank + self.cfg.qk_rope_head_dim
        stacked = torch.zeros(len(self.layers), num_pages + 1, page_size, width, dtype=dtype, device=device)
        return list(stacked.unbind(0))

    def forward_paged(
        self,
        input_ids: torch.Tensor,
        meta: ForwardMeta | PrefillMeta,
        caches: list[torch.Tensor],
        hidden_layers: tuple[int, ...] = (),
        *,
        logit_rows: torch.Tensor | None = None,
        router_ids: list[torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Prefill chunk, decode step or tree verify over the paged cache.

        input_ids int64 [B, N]: the new rows (for a tree: the root, then nodes in DraftTrees order).
        meta: ForwardMeta runs MLA's absorbed form (the tree-verify kernel on CUDA), any visibility;
              PrefillMeta runs its non-absorbed causal form (SDPA over the expanded latents), the
              prefill path. Both write row n's entry at slot prefix + n.
        logit_rows: optional int64 [B], the one row per request whose logits are wanted (a prefill
                    chunk needs only its last); the others skip the final norm and lm_head.
        router_ids: optional list; each MoE layer appends its expert ids int64 [B * N, k].
        Returns logits float32 [B, N, vocab] ([B, 1, vocab] with logit_rows) and the chosen
        layers' outputs [B, N, hidden].
        """
        x = self.embed(input_ids)
        rope = rotary_cos_sin(meta.positions, self.inv_freq, self.rope_factor, x.dtype)  # once, not per layer
        captured, delta = [], None
        for i, (layer, cache) in enumerate(zip(self.layers, caches)):
            x, delta = layer.forward_paged(x, delta, meta, cache, rope, router_ids)
            if i in hidden_layers:
                captured.append(x + delta)
        if logit_rows is not None:
            rows = logit_rows.view(-1, 1, 1).expand(-1, 1, x.shape[-1])
            x, delta = x.gather(1, rows), (None if delta is None else delta.gather(1, rows))
        return self.logits_of(self.norm(x) if delta is None else self.norm(x, delta)[1]), captured

    def fuse_input_projections(self) -> None:
        """One GEMM for the inputs of every layer's attention (MLA.fuse_input_projections) and of
        every MLP's gate and up projections (the dense MLPs and the shared experts); the loader
        calls it before any weight is copied in."""
        for layer in self.layers:
            layer.self_attn.fuse_input_projections()
            mlp = layer.mlp.shared_experts if isinstance(layer.mlp, MoE) else layer.mlp
            if mlp is not None:
                mlp.fuse_input_projections()

    @torch.no_grad()
    def logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Causal full-sequence logits float32 [B, T, vocab] for equal-length ids [B, T]."""
        return self(input_ids)[0]
