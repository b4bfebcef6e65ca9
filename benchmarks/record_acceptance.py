"""Record what the demo pair's drafter proposes, round by round, against what the target then chose.

For every round of `ddtree` (greedy, one prompt at a time) on the held-out prompts, the drafter's
top-K log-probabilities at each of the D drafted positions, and the rank among them of the token
the target actually produced there (-1: not in the top K). Greedy decoding is lossless, so the
target's token at each position is read from the finished output. Rounds whose D positions are
not all known (past the end of an output) are left out.

benchmarks/replay_drafter.py replays these rounds on real-size random targets, so that, per depth,
the rank of the target's token and the drafter's probabilities follow what the demo pair does.

    python benchmarks/record_acceptance.py --device cpu     # about two minutes on two cores
Writes benchmarks/data/demo_acceptance.safetensors (ranks int16 [R, D], logprobs float16
[R, D, K]) and demo_acceptance.json (how it was made, and per depth the share of rounds whose
target token was rank 0, ranks 1..K-1, or missing).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import environment  # noqa: E402

from ddtree import Engine  # noqa: E402
from ddtree.tree import topk_logprobs  # noqa: E402

DATA = Path(__file__).resolve().parent / "data"


class RecordingDrafter:
    """Wraps a Drafter: each draft_logits call keeps slot 0's context length and top-K draft."""

    def __init__(self, drafter, k: int):
        self.inner, self.k, self.calls = drafter, k, []
        self.cfg = drafter.cfg

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def draft_logits(self, target, bonus, cache, key_limit=None):
        logits = self.inner.draft_logits(target, bonus, cache, key_limit)
        lp, tok = topk_logprobs(logits[:1], self.k)
        self.calls.append((int(cache.lengths[0]), lp[0].cpu(), tok[0].cpu()))
        return logits


def record(engine: Engine, recorder: RecordingDrafter, prompts: list[str], new: int, budget: int):
    ranks, logprobs, rounds = [], [], 0
    for prompt in prompts:
        recorder.calls.clear()
        out = engine.generate([prompt], max_new_tokens=new, mode="ddtree", budget=budget, temperature=0.0)[0]
        rounds += out.stats.rounds
        sequence = out.prompt_token_ids + out.token_ids
        for length, lp, tok in recorder.calls:
            positions = [length + d for d in range(1, lp.shape[0] + 1)]
            if positions[-1] >= len(sequence):
                continue  # the output ended before the block did: its truth is unknown
            truth = torch.tensor([sequence[p] for p in positions])
            hit = tok == truth[:, None]
            ranks.append(torch.where(hit.any(1), hit.int().argmax(1), -1))
            logprobs.append(lp)
    return torch.stack(ranks).to(torch.int16), torch.stack(logprobs).to(torch.float16), rounds


def summary(ranks: torch.Tensor, k: int) -> list[dict]:
    rows = []
    for d in range(ranks.shape[1]):
        col = ranks[:, d].long()
        rows.append({"depth": d + 1, "rank0": float((col == 0).float().mean()),
                     "rank1_to_k": float(((col > 0) & (col < k)).float().mean()), "missing": float((col < 0).float().mean())})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--prompts", type=Path, default=DATA / "demo_prompts.jsonl")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--budget", type=int, default=64, help="the ddtree budget of the recorded rounds")
    parser.add_argument("--k", type=int, default=32, help="top-K log-probs kept per depth")
    parser.add_argument("--out", type=Path, default=DATA / "demo_acceptance")
    args = parser.parse_args()

    engine = Engine.from_pretrained(device=args.device, max_batch=1, overlap=False, kept_costs="off")
    recorder = RecordingDrafter(engine.drafter, args.k)
    engine.drafter = engine.ctx.drafter = recorder
    prompts = [json.loads(line)["prompt"] for line in args.prompts.read_text().splitlines()]
    ranks, logprobs, rounds = record(engine, recorder, prompts, args.max_new_tokens, args.budget)
    save_file({"ranks": ranks, "logprobs": logprobs}, str(args.out.with_suffix(".safetensors")))
    meta = {"environment": environment(), "device": str(engine.device),
            "dtype": str(engine.target.embed_tokens.weight.dtype), "prompts": len(prompts),
            "max_new_tokens": args.max_new_tokens, "budget": args.budget, "k": args.k, "rounds_run": rounds,
            "rounds_recorded": int(ranks.shape[0]), "depths": int(ranks.shape[1]), "per_depth": summary(ranks, args.k)}
    args.out.with_suffix(".json").write_text(json.dumps(meta, indent=1) + "\n")
    print(f"recorded {ranks.shape[0]} of {rounds} rounds, D = {ranks.shape[1]}, K = {args.k} -> {args.out}.*")
    for row in meta["per_depth"]:
        print(f"  depth {row['depth']:2d}: rank 0 {row['rank0']:.3f}, ranks 1..{args.k - 1} {row['rank1_to_k']:.3f}, "
              f"missing {row['missing']:.3f}")


if __name__ == "__main__":
    main()
