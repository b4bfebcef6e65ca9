"""Regenerate the golden vectors: frozen inputs and reference outputs of the tree stage.

    python tests/golden/make_golden.py

Only rerun this on purpose (a deliberate change of the reference's contract); tests/tree/
test_golden.py then fails on any silent change of the reference itself.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
from safetensors.torch import save_file

from ddtree.tree import TREE_FIELDS, accept_paths, build_trees, topk_logprobs

HERE = Path(__file__).resolve().parent

# (name, B, D, V, K, budget, logit kind): ties, -inf, underfull, chains, depth 1, budget 1.
TREE_CASES = [
    ("bf16", 3, 6, 64, 32, 32, "bf16"),
    ("ties", 2, 4, 8, 8, 40, "integer"),
    ("underfull", 2, 3, 3, 3, 60, "normal"),
    ("chain", 2, 9, 16, 1, 6, "normal"),
    ("depth1", 2, 1, 16, 16, 7, "normal"),
    ("budget1", 2, 5, 16, 16, 1, "bf16"),
    ("zero_prob", 3, 5, 20, 10, 30, "zero_prob"),
]


def logits_of(kind: str, b: int, d: int, v: int, gen: torch.Generator) -> torch.Tensor:
    if kind == "integer":
        return torch.randint(-2, 2, (b, d, v), generator=gen).float()
    x = torch.randn(b, d, v, generator=gen) * 3
    return x.bfloat16() if kind == "bf16" else x


def tree_vectors() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(2026)
    out = {}
    for name, b, d, v, k, budget, kind in TREE_CASES:
        lp, tok = topk_logprobs(logits_of(kind, b, d, v, gen), k, backend="reference")
        if kind == "zero_prob":
            lp[0, 2:, 3:] = -math.inf
            lp[1, 0, :] = -math.inf
        trees = build_trees(lp, tok, budget, backend="reference")
        post = trees.tokens.new_zeros(b, budget + 1)
        for r in range(b):  # follow the first-numbered child at each node
            for i in range(int(trees.num_nodes[r]), 0, -1):
                post[r, trees.parents[r, i - 1]] = trees.tokens[r, i - 1]
        accepted, accept_len, bonus = accept_paths(trees, post, backend="reference")
        tensors = dict(top_logprobs=lp, top_tokens=tok, budget=torch.tensor(budget), posterior=post,
                       accepted=accepted, accept_len=accept_len, bonus=bonus)
        tensors.update({f: getattr(trees, f) for f in TREE_FIELDS})
        out.update({f"{name}.{key}": t.contiguous() for key, t in tensors.items()})
    return out


def topk_vectors() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    out = {}
    for name, logits in [
        ("fp32", torch.randn(2, 3, 300, generator=gen)),
        ("bf16_ties", (torch.randn(2, 3, 300, generator=gen) * 2).bfloat16()),
        ("integer", torch.randint(-3, 3, (2, 3, 300), generator=gen).half()),
    ]:
        lp, tok = topk_logprobs(logits, 40, backend="reference")
        out.update({f"{name}.logits": logits, f"{name}.logprobs": lp, f"{name}.tokens": tok})
    return out


def main() -> None:
    save_file(tree_vectors(), HERE / "tree.safetensors")
    save_file(topk_vectors(), HERE / "topk.safetensors")
    print("wrote", HERE / "tree.safetensors", HERE / "topk.safetensors")


if __name__ == "__main__":
    main()
