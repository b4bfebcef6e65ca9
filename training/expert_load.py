"""How evenly a trained target's routers spread held-out tokens over the routed experts.

    python -m training.expert_load --target src/ddtree/demo/target --heldout DATA/heldout.jsonl

Per MoE layer: the busiest expert's share over the mean share (1.0 is perfect balance; with top k
of E experts the most it can be is E / k), the least used expert's share of the choices, and how
many experts get under 1% of them. Reads held-out files (training/corpus.py's heldout.jsonl) in
order, tokenized with the target's own tokenizer, as 1024-token windows.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from transformers import AutoTokenizer

from ddtree.models import load_target
from ddtree.models.layers import MoE


@torch.no_grad()
def expert_loads(target, windows: torch.Tensor) -> list[torch.Tensor]:
    """windows int64 [W, T] -> per MoE layer, float64 [experts]: the share of choices each got."""
    moes = [layer.mlp for layer in target.layers if isinstance(layer.mlp, MoE)]
    counts = [torch.zeros(m.gate.weight.shape[0], dtype=torch.float64) for m in moes]

    def counter(c: torch.Tensor):
        def hook(module, inputs, output) -> None:  # returns None: the router's output stays as it is
            c.add_(torch.bincount(output[1].flatten(), minlength=c.numel()).double())
        return hook

    hooks = [m.gate.register_forward_hook(counter(c)) for m, c in zip(moes, counts)]
    try:
        for window in windows:
            target(window[None])
    finally:
        for h in hooks:
            h.remove()
    return [c / c.sum() for c in counts]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", type=Path, default=Path("src/ddtree/demo/target"))
    parser.add_argument("--heldout", type=Path, required=True, help="training/corpus.py's heldout.jsonl")
    parser.add_argument("--tokens", type=int, default=65536)
    parser.add_argument("--seq", type=int, default=1024)
    args = parser.parse_args()
    target = load_target(args.target, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(args.target)
    ids: list[int] = []
    with args.heldout.open() as f:
        for line in f:
            ids += tokenizer(json.loads(line)["text"])["input_ids"] + [tokenizer.eos_token_id]
            if len(ids) >= args.tokens:
                break
    usable = len(ids) // args.seq * args.seq
    windows = torch.tensor(ids[:usable]).view(-1, args.seq)
    shares = expert_loads(target, windows)
    print(f"{args.target}: {usable:,} held-out tokens")
    report = []
    for layer, share in enumerate(shares, 1):
        row = {"moe_layer": layer, "max_over_mean": float(share.max() * share.numel()),
               "min_share": float(share.min()), "experts_under_1pct": int((share < 0.01).sum())}
        report.append(row)
        print(f"MoE layer {layer}: busiest {row['max_over_mean']:.2f}x the mean, least used {row['min_share']:.1%}, "
              f"{row['experts_under_1pct']} under 1%")
    print(json.dumps({"tokens": usable, "layers": report}))


if __name__ == "__main__":
    main()
