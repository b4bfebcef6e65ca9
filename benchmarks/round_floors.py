"""Floors of each stage of a round: the bytes it must move and its FLOPs against measured ceilings.

floor = max(bytes / copy bandwidth, FLOPs / bf16 matmul rate), both ceilings measured in the same
run (common.measure_ceilings). Bytes count what the stage must read (weights once per round, the
routed experts its rows touched, cache entries) plus the cache entries it must write;
activations between kernels are not counted (a fused implementation need not write them), except
where a stage's input is the previous stage's materialized float32 logits (top-k, accept).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ddtree.models.layers import MoE

FORMULAS = {
    "draft": "bytes = e*(drafter layers + final norm + lm_head V*H) + e*B*S*H (embedding rows) "
             "+ e*Ld*B*(P+S)*2*kvh*hd (context + block keys/values) + e*B*D*V (the logits written); "
             "FLOPs = 2*B*S*(drafter layer params) + 2*B*D*H*V + 4*Ld*B*S*(P+S)*nh*hd",
    "topk": "bytes = e*B*D*V (the draft logits, in the model's dtype); FLOPs = 0",
    "build": "bytes = B*D*K*(4+8) (top-k log-probs, tokens) + 3*8*B*n + 8*B*N*ceil(N/64) (tree out); FLOPs = 0",
    "verify": "bytes = e*(dense params: every weight but the embedding and the routed experts, lm_head included) "
              "+ (bytes per routed expert: e*3*H*I_moe, or INT4's packed words and scales)*(distinct routed experts "
              "the batch's rows touched, summed over MoE layers) "
              "+ e*B*N*H (embedding rows) + e*L*B*(P+N)*W (latent cache: prefix read, new rows written); "
              "FLOPs = 2*B*N*(dense params + MoE layers*k*3*H*I_moe) + 2*L*B*N*heads*(P+1)*(W+kv_lora_rank)",
    "accept": "bytes = 4*B*N*V (the float32 verify logits the argmax reads); FLOPs = 0",
    "commit": "tree: bytes = 2*e*L*B*D*W (gather + scatter of the accepted entries) + e*(fc + hidden_norm + drafter "
              "k/v projections) + e*B*(D+1)*F*H (features) + e*Ld*B*(D+1)*2*kvh*hd (context written); "
              "FLOPs = 2*B*(D+1)*(those drafter params). ar: bytes = 2*12*B (prefix length and bonus), FLOPs = 0",
    "round": "sum of the stage floors",
    "weight_read": "e*(dense params + routed experts touched) / copy bandwidth (the ar bar's denominator)",
}
LEGEND = ("e: bytes per weight / cache element (2 for bf16); B: batch; P: prefix; n: tree budget (nodes); N = n + 1 rows "
          "(1 for ar); V: vocab; H: hidden; L: target layers; W = kv_lora_rank + qk_rope_head_dim (576); D = block - 1; "
          "S = block; K = min(n, V); Ld, nh, kvh, hd: drafter layers, heads, key/value heads, head dim; F: feature layers")


@dataclass(frozen=True)
class ModelCounts:
    """Parameter counts the formulas need, read off the built models."""

    dense: int  # target params read whole per forward: all but the embedding and the routed experts
    per_expert: int  # 3 * H * moe_intermediate (weights, for the FLOPs)
    expert_bytes: float  # bytes one routed expert is stored in (2 * per_expert in bf16; INT4: packed + scales)
    layers: int
    moe_layers: int
    dense_per_moe_layer: int  # one MoE layer's params but its routed experts (attention, router, shared experts)
    draft_weights: int  # drafter layers + final norm (the draft pass)
    context_weights: int  # fc + hidden_norm + every layer's k/v projection and k_norm (append_context)
    element: int  # bytes per weight element

    @classmethod
    def of(cls, target, drafter) -> "ModelCounts":
        count = lambda params: sum(p.numel() for p in params)  # noqa: E731
        moe_layers = [layer for layer in target.layers if isinstance(layer.mlp, MoE)]
        moes = [layer.mlp for layer in moe_layers]
        stored = lambda m: list(m.parameters(recurse=False))  # noqa: E731  the routed experts, in whatever storage
        routed = count(p for m in moes for p in stored(m))
        one = count(moe_layers[0].parameters()) - count(stored(moes[0])) if moes else 0
        cfg = target.cfg
        expert_bytes = sum(p.numel() * p.element_size() for p in stored(moes[0])) / cfg.n_routed_experts if moes else 0
        context = count(drafter.fc.parameters()) + count(drafter.hidden_norm.parameters()) + count(
            p for layer in drafter.layers for mod in (layer.self_attn.k_proj, layer.self_attn.v_proj, layer.self_attn.k_norm)
            for p in mod.parameters())
        return cls(dense=count(target.parameters()) - target.embed_tokens.weight.numel() - routed,
                   per_expert=3 * cfg.hidden_size * cfg.moe_intermediate_size, expert_bytes=expert_bytes,
                   layers=len(target.layers),
                   moe_layers=len(moes), dense_per_moe_layer=one,
                   draft_weights=count(drafter.layers.parameters()) + count(drafter.norm.parameters()),
                   context_weights=context, element=target.embed_tokens.weight.element_size())

    def with_layers(self, layers: int) -> "ModelCounts":
        """The same model grown to `layers` by repeating its MoE layer (its first layers kept)."""
        extra = layers - self.layers
        return replace(self, dense=self.dense + extra * self.dense_per_moe_layer, layers=layers,
                       moe_layers=self.moe_layers + extra)


def _floor(nbytes: float, flops: float, ceilings: dict) -> dict:
    memory = nbytes / (ceilings["copy_bandwidth_GBps"] * 1e3)  # GB/s -> bytes per microsecond
    compute = flops / (ceilings["bf16_matmul_TFLOPs"] * 1e6)
    return {"bytes": nbytes, "flops": flops, "floor_us": max(memory, compute),
            "bound": "memory" if memory >= compute else "compute"}


def stage_floors(cfg, dcfg, counts: ModelCounts, batch: int, budget: int, prefix: int, touched: float,
                 ceilings: dict) -> dict[str, dict]:
    """Floor of every stage of one round (budget 0: ar's verify, accept, commit), plus the round
    and the weight-read floor. cfg / dcfg: target and drafter configs; counts: their parameters
    (and the target's layer count); touched: distinct routed experts the verify touched, summed
    over MoE layers (the whole batch's rows together)."""
    e = counts.element
    vocab, hidden, layers = cfg.vocab_size, cfg.hidden_size, counts.layers
    width = cfg.kv_lora_rank + cfg.qk_rope_head_dim
    rows = budget + 1
    weights = e * counts.dense + touched * counts.expert_bytes
    verify_bytes = weights + e * batch * rows * hidden + e * layers * batch * (prefix + rows) * width
    verify_flops = 2 * batch * rows * (counts.dense + counts.moe_layers * cfg.num_experts_per_tok * counts.per_expert)
    verify_flops += 2 * layers * batch * rows * cfg.num_attention_heads * (prefix + 1) * (width + cfg.kv_lora_rank)
    out = {"verify": _floor(verify_bytes, verify_flops, ceilings),
           "accept": _floor(4 * batch * rows * vocab, 0, ceilings)}
    if budget == 0:
        out["commit"] = _floor(2 * 12 * batch, 0, ceilings)
    else:
        block, depth = dcfg.block_size, dcfg.block_size - 1
        kv = 2 * dcfg.num_key_value_heads * dcfg.head_dim
        attn = dcfg.num_attention_heads * dcfg.head_dim
        draft_bytes = e * (counts.draft_weights + vocab * hidden) + e * batch * block * hidden
        draft_bytes += e * dcfg.num_hidden_layers * batch * (prefix + block) * kv + e * batch * depth * vocab
        draft_flops = 2 * batch * block * counts.draft_weights + 2 * batch * depth * hidden * vocab
        draft_flops += 4 * dcfg.num_hidden_layers * batch * block * (prefix + block) * attn
        k = min(budget, vocab)
        features = len(dcfg.target_layer_ids) * hidden
        commit_bytes = 2 * e * layers * batch * depth * width + e * counts.context_weights
        commit_bytes += e * batch * (depth + 1) * features + e * dcfg.num_hidden_layers * batch * (depth + 1) * kv
        out = {"draft": _floor(draft_bytes, draft_flops, ceilings),
               "topk": _floor(e * batch * depth * vocab, 0, ceilings),
               "build": _floor(batch * depth * k * 12 + 24 * batch * budget + 8 * batch * rows * -(-rows // 64), 0,
                               ceilings),
               **out,
               "commit": _floor(commit_bytes, 2 * batch * (depth + 1) * counts.context_weights, ceilings)}
    out["round"] = {"floor_us": sum(s["floor_us"] for s in out.values()),
                    "bytes": sum(s["bytes"] for s in out.values()), "flops": sum(s["flops"] for s in out.values())}
    out["weight_read"] = _floor(weights, 0, ceilings)
    return out


def uniform_touched(cfg, tokens: int) -> float:
    """Expected distinct routed experts per MoE layer for `tokens` rows under uniform routing."""
    experts, k = cfg.n_routed_experts, cfg.num_experts_per_tok
    return experts * (1 - (1 - k / experts) ** tokens) if experts else 0.0
