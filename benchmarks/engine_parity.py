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
prefill of prompt + ar[:j]) differ by less than the bf16 forward's own error on those two logits.
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
from ddtree.engine.oracle import OracleDrafter  # noqa: E402
from ddtree.models import Drafter, DrafterConfig, TargetConfig, random_target  # noqa: E402

CONFIGS = Path(__file__).resolve().parent / "configs"


def build_pair(config: str, layers: int, logit_std: float, device: str, dtype=torch.bfloat16):
    path = Path(config) if config.endswith(".json") else CONFIGS / f"{config}.json"
    raw = json.loads(path.read_text())
    raw["num_hidden_layers"] = layers
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


@torch.no_grad()
def classify(target32, target16, prompt, ar, tree, j):
    """Float32 gap between the two tokens at the first divergence j, and bf16's error on them."""
    ids = torch.tensor([prompt + ar[:j]], device=target16.embed_tokens.weight.device)
    l32 = target32.logits(ids)[0, -1]
    l16 = target16.logits(ids)[0, -1].float()
    a, b = ar[j], tree[j]
    gap = abs(float(l32[a] - l32[b]))
    err = max(abs(float(l32[a] - l16[a])), abs(float(l32[b] - l16[b])))
    return {"index": j, "ar_token": a, "tree_token": b, "fp32_gap": gap, "bf16_error": err, "near_tie": gap <= 2 * err}


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
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("engine_parity.py needs a CUDA GPU (--device cpu for a dry run)")
    target, drafter = build_pair(args.config, args.layers, args.logit_std, args.device)
    gen = torch.Generator().manual_seed(3)
    lengths = torch.randint(16, 400, (args.prompts,), generator=gen).tolist()
    batch = [torch.randint(0, target.cfg.vocab_size - 1, (n,), generator=gen).tolist() for n in lengths]
    target32 = float_copy(target)
    results = []
    for dtype_name, tgt, dft in (("bf16", target, drafter), ("fp32", target32, float_copy(drafter))):
        plain = Engine(tgt, dft, max_batch=args.batch, max_model_len=1024, stop_token_ids=())
        ar_outs, ar_s = run(plain, batch, args.new, "ar", 1)
        ar = [o.token_ids for o in ar_outs]
        oracle = OracleDrafter(dft, max_batch=args.batch, max_len=1024)
        forced = Engine(tgt, oracle, max_batch=args.batch, max_model_len=1024, stop_token_ids=())
        runs = [("chain", 1, plain, "random"), ("ddtree", 16, plain, "random"), ("ddtree", 64, plain, "random"),
                ("chain", 1, forced, "oracle"), ("ddtree", 64, forced, "oracle")]
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
        ties = sum(d["near_tie"] for d in div)
        first = statistics.median(d["index"] for d in div) if div else "-"
        worst = max((d["fp32_gap"] / max(d["bf16_error"], 1e-9) for d in div), default=0.0)
        table_rows.append([r["dtype"], r["mode"], r["budget"] if r["mode"] == "ddtree" else "-", r["drafter"],
                           f"{r['equal']}/{r['requests']}", f"{r['mean_acceptance']:.2f}", len(div), first,
                           f"{ties}/{len(div)}", f"{worst:.2f}"])
    table = markdown_table(["dtype", "mode", "budget", "drafter", "equal to ar", "mean accept", "divergences",
                            "median first divergence", "near-ties", "max gap / bf16 error"], table_rows)
    header = (f"{args.config} shape, first {args.layers} layers, random weights, lm_head scaled to logit std "
              f"{args.logit_std}; {args.prompts} prompts of 16-399 random tokens, {args.new} new tokens each, greedy, "
              f"batches of {args.batch}. Near-tie: the two tokens' fp32 logits differ by at most twice the bf16 "
              "forward's error on them.\n\n")
    payload = {"environment": environment(), "args": vars(args) | {"out": str(args.out)}, "results": results}
    print(header + table)
    print("wrote", write_results("engine_parity", payload, header + table, args.out))


if __name__ == "__main__":
    main()
