"""Greedy parity of the engine on the GPU: how often `chain` / `ddtree` outputs equal `ar` in bf16,
where the first divergence falls, and whether each divergence is a near-tie.

Target: the first --layers layers of Moonlight-16B-A3B's shape (benchmarks/configs), random bf16
weights made on the GPU, lm_head scaled so next-token logits have std --logit-std (peaked like a
trained model's, not the near-uniform logits of raw random weights). Drafter: a random DFlash
drafter of matching width (block 16), used as is (low acceptance: tree-shaped verifies of up to
budget + 1 rows against ar's one-row decode) and as an oracle proposing ar's own continuation
(deep commits through the gather-then-scatter). A float32 copy of the same weights on the same
GPU is the control.

A divergence at generated token j is a near-tie when the two tokens' float32 logits (plain causal
prefill of prompt + ar[:j]) differ by at most twice the bf16 forwards' own error on those two
logits (plain prefill, and the engine's paged prefill + one-row decode); otherwise a router flip
when bf16 and float32 send some token of that sequence to different experts; otherwise unexplained.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import environment, markdown_table, write_results  # noqa: E402

from ddtree import Engine  # noqa: E402
from oracle import OracleDrafter  # noqa: E402
from ddtree.models import Drafter, DrafterConfig, ForwardMeta, TargetConfig, random_target  # noqa: E402
from ddtree.tree import pack_visibility  # noqa: E402

CONFIGS = Path(__file__).resolve().parent / "configs"


def build_pair(config: str, layers: int, logit_std: float, device: str, dense: bool, dtype=torch.bfloat16):
    path = Path(config) if config.endswith(".json") else CONFIGS / f"{config}.json"
    raw = json.loads(path.read_text())
    raw["num_hidden_layers"] = layers
    if dense:
        raw["n_routed_experts"] = 0
    cfg = TargetConfig.from_dict(raw)
    target = random_target(cfg, dtype=dtype, device=device, seed=0)
    with torch.no_grad():
        probe = torch.randint(0, cfg.vocab_size, (4, 64), generator=torch.Generator().manual_seed(1)).to(device)
        std = target.logits(probe).std().item()
        target.lm_head.weight.mul_(logit_std / std)
    drafter_raw = dict(
        architectures=["DFlashDraftModel"], hidden_size=cfg.hidden_size, intermediate_size=4 * cfg.hidden_size,
        num_hidden_layers=2, num_attention_heads=16, num_key_value_heads=4, head_dim=128, rms_norm_eps=1e-6,
        rope_theta=1e6, vocab_size=cfg.vocab_size,
        dflash_config={"target_layer_ids": list(range(layers)), "block_size": 16, "mask_token_id": cfg.vocab_size - 1})
    torch.manual_seed(2)
    with torch.device(device):
        drafter = Drafter(DrafterConfig.from_dict(drafter_raw)).to(dtype).eval()
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.02 * torch.randn_like(p))
    return target, drafter


def float_copy(model):
    import copy

    return copy.deepcopy(model).float()


def _router_choices(model, ids) -> list[torch.Tensor]:
    """Each MoE layer's expert ids [T, k] (sorted) for a plain causal forward of ids [1, T]."""
    seen, hooks = [], []
    for layer in model.layers:
        gate = getattr(layer.mlp, "gate", None)
        if gate is not None:
            hooks.append(gate.register_forward_hook(lambda _m, _i, out: seen.append(out[1].sort(-1).values)))
    try:
        logits = model.logits(ids)
    finally:
        for h in hooks:
            h.remove()
    return logits, seen


def decode_logits(model, ids: torch.Tensor) -> torch.Tensor:
    """float32 [V]: the engine's own path to the next-token logits of ids [1, T]: a paged prefill of
    T - 1 tokens (the tree kernel in bf16), then a one-row decode step over the paged cache."""
    page, t = 64, ids.shape[1]
    pages = -(-t // page)
    caches = model.new_cache(pages, page)
    table = torch.arange(pages, dtype=torch.int32, device=ids.device)[None]

    def forward(rows: torch.Tensor, start: int):
        n = rows.shape[1]
        seen = torch.ones(n, n, dtype=torch.bool, device=ids.device).tril()
        meta = ForwardMeta.build(table, torch.tensor([start], dtype=torch.int32, device=ids.device),
                                 torch.tensor([n], dtype=torch.int32, device=ids.device),
                                 start + torch.arange(n, device=ids.device)[None], pack_visibility(seen)[None],
                                 page_size=page, scratch_page=pages)
        return model.forward_paged(rows, meta, caches)[0]

    if t > 1:
        forward(ids[:, :-1], 0)
    return forward(ids[:, -1:], t - 1)[0, -1]


@torch.no_grad()
def classify(target32, target16, prompt, ar, tree, j):
    """At the first divergence j: the float32 gap between the two tokens, bf16's own error on them
    (the larger of a plain causal prefill's and the engine's paged decode path's, on prompt + ar[:j],
    against the float32 prefill), which token float32 prefers, and
    whether bf16 and float32 route any token of that sequence to different experts.

    near-tie: the gap is within twice bf16's error. router flip: routing is discrete, so a bf16
    rounding that reorders two router scores changes an expert and moves the logits by far more
    than rounding; two bf16 execution paths (decode vs verify shapes) differ the same way.
    """
    ids = torch.tensor([prompt + ar[:j]], device=target16.embed_tokens.weight.device)
    l32, r32 = _router_choices(target32, ids)
    l16, r16 = _router_choices(target16, ids)
    l32, l16 = l32[0, -1], l16[0, -1].float()
    paged16 = decode_logits(target16, ids)
    a, b = ar[j], tree[j]
    gap = abs(float(l32[a] - l32[b]))
    err = max(abs(float(l32[v] - other[v])) for v in (a, b) for other in (l16, paged16))
    flips = sum(int((x != y).any(-1).sum()) for x, y in zip(r32, r16))  # (token, layer) pairs routed differently
    near_tie = gap <= 2 * err
    reason = "logit near-tie" if near_tie else "router flip" if flips else "unexplained"
    return {"index": j, "ar_token": a, "tree_token": b, "fp32_gap": gap, "bf16_error": err, "near_tie": near_tie,
            "fp32_prefers": "ar" if l32[a] >= l32[b] else "tree", "router_flips": flips,
            "routed_tokens": ids.shape[1] * len(r32), "reason": reason}


def run(engine, batch, new, mode, budget):
    start = time.perf_counter()
    outs = engine.generate(batch, max_new_tokens=new, mode=mode, budget=budget)
    return outs, time.perf_counter() - start


def compare(name, outs, ar, batch, target32, target16):
    divergences = []
    for p, o, a in zip(batch, outs, ar):
        if o.token_ids != a:
            j = next(i for i, (x, y) in enumerate(zip(o.token_ids, a)) if x != y)
            divergences.append(classify(target32, target16, p, a, o.token_ids, j))
    lengths = [x for o in outs for x in o.stats.acceptance_lengths]
    return {"run": name, "requests": len(outs), "equal": len(outs) - len(divergences),
            "mean_acceptance": sum(lengths) / len(lengths), "divergences": divergences}


@torch.no_grad()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="moonlight-16b-a3b", help="a name under benchmarks/configs/ or a .json path")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--device", default="cuda", help="cpu only for a dry run of the script")
    parser.add_argument("--prompts", type=int, default=48)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--logit-std", type=float, default=3.0)
    parser.add_argument("--dense", action="store_true", help="replace the routed experts by dense MLPs (no routing)")
    parser.add_argument("--quick", action="store_true", help="bf16 only: chain, ddtree 64, ddtree 64 with the oracle")
    parser.add_argument("--name", default="engine_parity", help="results file name")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("engine_parity.py needs a CUDA GPU (--device cpu for a dry run)")
    target, drafter = build_pair(args.config, args.layers, args.logit_std, args.device, args.dense)
    gen = torch.Generator().manual_seed(3)
    lengths = torch.randint(16, 400, (args.prompts,), generator=gen).tolist()
    batch = [torch.randint(0, target.cfg.vocab_size - 1, (n,), generator=gen).tolist() for n in lengths]
    target32 = float_copy(target)
    results = []
    precisions = [("bf16", target, drafter)] + ([] if args.quick else [("fp32", target32, float_copy(drafter))])
    for dtype_name, tgt, dft in precisions:
        plain = Engine(tgt, dft, max_batch=args.batch, max_model_len=1024, stop_token_ids=())
        ar_outs, ar_s = run(plain, batch, args.new, "ar", 1)
        ar = [o.token_ids for o in ar_outs]
        oracle = OracleDrafter(dft, max_batch=args.batch, max_len=1024)
        forced = Engine(tgt, oracle, max_batch=args.batch, max_model_len=1024, stop_token_ids=())
        runs = [("chain", 1, plain, "random"), ("ddtree", 16, plain, "random"), ("ddtree", 64, plain, "random"),
                ("chain", 1, forced, "oracle"), ("ddtree", 64, forced, "oracle")]
        if args.quick:
            runs = [runs[0], runs[2], runs[4]]
        for mode, budget, engine, kind in runs:
            if kind == "oracle":  # generate fills slots in order, batch by batch: slot = index % batch
                outs = []
                for start in range(0, len(batch), args.batch):
                    chunk = batch[start : start + args.batch]
                    for slot, (p, a) in enumerate(zip(chunk, ar[start : start + args.batch])):
                        oracle.set_sequence(slot, p + a)
                    outs += run(engine, chunk, args.new, mode, budget)[0]
            else:
                outs = run(engine, batch, args.new, mode, budget)[0]
            row = compare(f"{dtype_name} {mode} {budget if mode == 'ddtree' else ''} {kind}".replace("  ", " "),
                          outs, ar, batch, target32, target)
            row.update(dtype=dtype_name, mode=mode, budget=budget, drafter=kind, ar_seconds=ar_s)
            print(json.dumps({k: v for k, v in row.items() if k != "divergences"}), len(row["divergences"]), flush=True)
            results.append(row)
    table_rows = []
    for r in results:
        div = r["divergences"]
        ties = sum(d["reason"] == "logit near-tie" for d in div)
        flips = sum(d["reason"] == "router flip" for d in div)
        other = sum(d["reason"] == "unexplained" for d in div)
        first = statistics.median(d["index"] for d in div) if div else "-"
        prefers_ar = sum(d["fp32_prefers"] == "ar" for d in div)
        table_rows.append([r["dtype"], r["mode"], r["budget"] if r["mode"] == "ddtree" else "-", r["drafter"],
                           f"{r['equal']}/{r['requests']}", f"{r['mean_acceptance']:.2f}", len(div), first,
                           ties, flips, other, f"{prefers_ar}/{len(div)}"])
    table = markdown_table(["dtype", "mode", "budget", "drafter", "equal to ar", "mean accept", "divergences",
                            "median first divergence", "logit near-ties", "router flips", "unexplained",
                            "fp32 prefers ar's token"], table_rows)
    header = (f"{args.config} shape, first {args.layers} layers, random weights, lm_head scaled to logit std "
              f"{args.logit_std}; {args.prompts} prompts of 16-399 random tokens, {args.new} new tokens each, greedy, "
              f"batches of {args.batch}{'; routed experts replaced by dense MLPs' if args.dense else ''}. Each first "
              "divergence is a logit near-tie (the two tokens' fp32 logits differ by at most twice the bf16 forwards' "
              "error on them: plain prefill and the engine's paged decode path), else a router flip (bf16 and fp32 route some token of the sequence to different "
              "experts), else unexplained.\n\n")
    payload = {"environment": environment(), "args": vars(args) | {"out": str(args.out)}, "results": results}
    print(header + table)
    print("wrote", write_results(args.name, payload, header + table, args.out))


if __name__ == "__main__":
    main()
