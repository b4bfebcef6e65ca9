"""The random pair of benchmarks/engine_round.py and a batch that already holds a prefix.

Target: a config from benchmarks/configs/ (or `tiny`, built here, for CPU smoke runs) with
random_target's weight distributions, made on the device directly in bf16 (random_model), then
two changes that make its greedy next token a known function of the current token, the same
under every numeric path:

  - the embedding is redrawn at twice the rms of what the decoder layers add to the residual
    stream (measured on a probe), so the last hidden state keeps most of the current token's
    embedding (routing then follows mostly the token, as in trained models);
  - lm_head row perm[t] is ALPHA times the unit vector of embedding t: after token t the target
    picks perm[t] by tens of logits, while for a hidden state aligned with no embedding (the
    drafter's) the logits are N(0, ALPHA^2) over the vocabulary, like a random model's.

A plain random target's argmaxes are near-ties that bf16 rounding flips between the decode and
the verify shapes (results/engine_parity: acceptance 1.3 where the oracle proposes 15 tokens), so
acceptance could not be forced. Shapes, FLOPs and bytes are unchanged; routing still depends on
every row's hidden state. The mask token's embedding row is zero: the drafter's masked positions
carry no token's direction, only what its layers compute.

Drafter: DFlash of matching width (hidden = the target's, 5 layers, block 16, head_dim 128,
8 key/value heads, intermediate 3 x hidden), weights N(0, 0.02), norms 1, reading 5 target
layers chosen as DFlash does (all of them when the target has fewer).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from ddtree.engine.batch import BatchState, SlotSettings
from ddtree.engine.pages import pages_for
from ddtree.engine.round import RoundContext
from ddtree.models import Drafter, DrafterConfig, Target, TargetConfig, check_pair
from ddtree.models.checkpoint import init_random, random_target
from ddtree.models.drafter_config import reference_layer_ids

CONFIGS = Path(__file__).resolve().parent / "configs"
ALPHA = 3.0  # logit std of a hidden state unrelated to any embedding (engine_parity's --logit-std)
EMBED_OVER_ADDED = 2.0  # embedding rms / rms the layers add: cos(hidden, own embedding) ~ 0.9
TINY = dict(  # DeepseekV3-shaped, a few MB: the whole script runs on a CPU in seconds
    architectures=["DeepseekV3ForCausalLM"], vocab_size=4096, hidden_size=128, intermediate_size=256,
    moe_intermediate_size=32, num_hidden_layers=3, num_attention_heads=2, q_lora_rank=None, kv_lora_rank=32,
    qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16, n_routed_experts=8, n_shared_experts=1,
    num_experts_per_tok=2, first_k_dense_replace=1, moe_layer_freq=1, n_group=1, topk_group=1,
    topk_method="noaux_tc", scoring_func="sigmoid", norm_topk_prob=True, routed_scaling_factor=2.0,
    rms_norm_eps=1e-6, rope_theta=10000.0, rope_scaling=None, max_position_embeddings=8192)


def target_config(name: str, layers: int | None) -> tuple[TargetConfig, int, dict]:
    """(the config with its first `layers` decoder layers, the published layer count, the
    drafter shape the config file names under "benchmark_drafter": {} when none)."""
    raw = dict(TINY) if name == "tiny" else json.loads((CONFIGS / f"{name}.json").read_text())
    drafter = raw.pop("benchmark_drafter", {})
    full = raw["num_hidden_layers"]
    if layers:
        raw["num_hidden_layers"] = layers
    return TargetConfig.from_dict(raw), full, drafter


def dflash_layer_ids(target_layers: int, count: int = 5) -> list[int]:
    """DFlash's choice of target layers (models.drafter_config.reference_layer_ids), or every layer of a
    target too shallow for it (a benchmark's slice of a few layers)."""
    if target_layers - 3 < count:
        return list(range(min(count, target_layers)))
    return reference_layer_ids(target_layers, count)


def drafter_config(cfg: TargetConfig, layers: int = 5, block_size: int = 16, heads: int | None = None,
                   kv_heads: int | None = None) -> DrafterConfig:
    """A DFlash drafter for `cfg`: head_dim 128 (32 on toy widths), `heads` query heads (default
    hidden / head_dim) sharing `kv_heads` key / value heads (default min(8, heads))."""
    head_dim = 128 if cfg.hidden_size >= 1024 else 32
    heads = heads or max(1, cfg.hidden_size // head_dim)
    return DrafterConfig.from_dict(dict(
        architectures=["DFlashDraftModel"], hidden_size=cfg.hidden_size, intermediate_size=3 * cfg.hidden_size,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads or min(8, heads),
        head_dim=head_dim, rms_norm_eps=1e-6, rope_theta=1e6, vocab_size=cfg.vocab_size,
        dflash_config={"target_layer_ids": dflash_layer_ids(cfg.num_hidden_layers, layers), "block_size": block_size,
                       "mask_token_id": cfg.vocab_size - 1}))


def random_model(module_type, cfg, dtype, device, seed: int) -> torch.nn.Module:
    """A Target or Drafter with random_target's weight distributions, made on `device` directly
    in `dtype` (built on the meta device, so no float32 copy ever exists)."""
    if module_type is Target:
        return random_target(cfg, dtype=dtype, device=device, seed=seed).requires_grad_(False)
    with torch.device("meta"):
        model = module_type(cfg)
    model = init_random(model.to(dtype).to_empty(device=device), seed=seed)
    return model.eval().requires_grad_(False)


@torch.no_grad()
def successor_target(cfg: TargetConfig, dtype, device, mask_token: int, seed: int = 0):
    """random_target's weights, then the embedding and lm_head changes of the module docstring.
    Returns (target, perm int64 [V] on the device, probe report)."""
    target = random_model(Target, cfg, dtype, device, seed)
    gen = torch.Generator(device=device).manual_seed(seed + 7)
    vocab, last = cfg.vocab_size, cfg.num_hidden_layers - 1
    probe = torch.randint(0, vocab - 1, (2, 64), device=device, generator=gen)
    hidden = target(probe, hidden_layers=(last,))[1][0].float()
    added_rms = float((hidden - target.embed_tokens(probe).float()).pow(2).mean().sqrt())
    perm = torch.randperm(vocab, device=device, generator=gen)
    embed, head = target.embed_tokens.weight, target.lm_head.weight
    embed.normal_(0.0, EMBED_OVER_ADDED * added_rms, generator=gen)
    for rows in torch.arange(vocab, device=device).split(16384):  # chunks: no float32 copy of the whole table
        unit = embed[rows].float() / embed[rows].float().norm(dim=1, keepdim=True)
        head[perm[rows]] = (ALPHA * unit).to(head.dtype)
    embed[mask_token] = 0.0
    logits = target(probe)[0]
    top2 = logits.topk(2, dim=-1)
    report = {"layers_added_rms": added_rms, "embedding_std": EMBED_OVER_ADDED * added_rms, "lm_head_alpha": ALPHA,
              "probe_tokens": probe.numel(),
              "probe_successor_match": float((top2.indices[..., 0] == perm[probe]).float().mean()),
              "probe_min_margin_logits": float((top2.values[..., 0] - top2.values[..., 1]).min())}
    return target, perm, report


def build_pair(name: str, layers: int | None, device: torch.device, dtype=torch.bfloat16):
    """(target, drafter, perm, info dict); prints how long the build took."""
    start = time.perf_counter()
    cfg, full, drafter_shape = target_config(name, layers)
    dcfg = drafter_config(cfg, **drafter_shape)
    target, perm, probe = successor_target(cfg, dtype, device, dcfg.mask_token_id)
    check_pair(cfg, dcfg)
    drafter = random_model(Drafter, dcfg, dtype, device, seed=1)
    count = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    info = {"target_layers": cfg.num_hidden_layers, "published_layers": full, "target_parameters": count(target),
            "drafter_parameters": count(drafter), "drafter": {k: getattr(dcfg, k) for k in (
                "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "head_dim", "block_size", "target_layer_ids", "mask_token_id")}, "probe": probe}
    print(f"built {name} ({cfg.num_hidden_layers} layers, {info['target_parameters'] / 1e9:.2f} B) + drafter "
          f"({info['drafter_parameters'] / 1e9:.2f} B) in {time.perf_counter() - start:.1f} s; probe {probe}", flush=True)
    return target, drafter, perm, info


class PrefixBatch:
    """`batch` active slots, each with `prefix` committed tokens: the latent cache and the
    drafter's context hold random normal entries there (timing does not depend on their values),
    block tables are a shuffled page set, bonuses are random tokens, greedy sampling.

    restore() puts back what a round advances (prefix_lens, bonus, drafter lengths), so every
    repeat runs the same round on the same prefix. What a round writes lands past the prefix (the
    verify's rows, the commit's moves, the drafter's block and context), which the next repeat
    rewrites before reading it: each repeat does the same work on the same values.
    """

    def __init__(self, target, drafter, batch: int, prefix: int, max_rows: int, page_size: int = 64, seed: int = 3):
        device = target.embed_tokens.weight.device
        gen = torch.Generator(device=device).manual_seed(seed)
        cfg, block = target.cfg, drafter.cfg.block_size
        self.max_depth, self.page_size = block - 1, page_size
        per_request = pages_for(prefix + max(max_rows, block), page_size)
        num_pages = batch * per_request
        self.caches = target.new_cache(num_pages, page_size)
        for cache in self.caches:
            cache.normal_(0.0, 1.0, generator=gen)
        self.key_limit = pages_for(prefix + block, 64) * 64  # as engine/scheduling.py bounds it
        self.state = BatchState(batch, per_request, device, drafter, self.key_limit)
        for slot in range(batch):
            self.state.occupy(slot, SlotSettings(node_limit=0, chain=False, temperature=0.0, top_k=0, top_p=1.0, seed=0))
        for k, v in zip(self.state.drafter.keys, self.state.drafter.values):
            k.normal_(0.0, 1.0, generator=gen)
            v.normal_(0.0, 1.0, generator=gen)
        table = torch.randperm(num_pages, device=device, generator=gen).view(batch, per_request).int()
        self.state.block_table.copy_(table)
        self.state.prefix_lens.fill_(prefix)
        self.state.drafter.lengths.fill_(prefix)
        self.state.bonus.copy_(torch.randint(0, cfg.vocab_size - 1, (batch,), device=device, generator=gen))
        self.ctx = RoundContext(target, drafter, self.caches, page_size, num_pages, drafter.cfg.target_layer_ids,
                                cfg.n_routed_experts)
        self._saved = [t.clone() for t in self._advanced()]

    def set_budget(self, budget: int) -> None:
        """Every slot may verify `budget` tree nodes (a ddtree request of that budget)."""
        self.state.node_limit.fill_(budget)

    def _advanced(self) -> list[torch.Tensor]:
        return [self.state.prefix_lens, self.state.bonus, self.state.drafter.lengths]

    def restore(self) -> None:
        for live, saved in zip(self._advanced(), self._saved):
            live.copy_(saved)
