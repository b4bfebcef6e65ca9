"""Train the demo target: a small Kimi-K2-architecture Python coder (training/demo_config.py).

    python -m training.train_target --data DATA --tokenizer TOKDIR --out OUT/target --minutes 7

Next-token cross-entropy on random windows of the training split, bf16 compute with float32
master weights; the noaux_tc router's correction bias follows DeepSeek-V3's auxiliary-loss-free
balancing (after each step, raised for under-loaded experts, lowered for over-loaded ones).
Writes a Hugging Face checkpoint (bf16 shards under 16 MiB, the tokenizer beside it), the loss
curve as PNG and the run log with the held-out perplexity.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from ddtree.models import Target, TargetConfig, random_target, save_target
from training.balance import RouterBalance
from training.data import TokenWindows
from training.demo_config import EOT_ID, SEQ_LEN, target_config
from training.loop import MasterAdamW, Schedule, environment, plot_losses, write_log
from training.moe_dense import use_dense_moe


def init_target(cfg: TargetConfig, device, dtype, seed: int) -> Target:
    """random_target's init (Normal(0, 0.02), norms 1, router bias 0), with the residual outputs
    scaled down to 0.02 / sqrt(2 * layers) and the embeddings tied when the config says so."""
    model = random_target(cfg, dtype=dtype, device=device, seed=seed, std=0.02)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight", "w_down")):
                p.mul_(1 / math.sqrt(2 * cfg.num_hidden_layers))
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    return model


@torch.no_grad()
def heldout_loss(model: Target, windows: TokenWindows, batch: int, limit_tokens: int | None, device) -> tuple[float, int]:
    """Mean next-token cross-entropy (nats) over disjoint held-out windows, and the tokens counted."""
    total, count = 0.0, 0
    for rows in windows.ordered(batch, limit_tokens, device):
        logits, _ = model(rows[:, :-1])
        total += float(F.cross_entropy(logits.flatten(0, 1), rows[:, 1:].flatten(), reduction="sum"))
        count += rows[:, 1:].numel()
    return total / count, count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, required=True, help="directory with train.npy / heldout.npy")
    parser.add_argument("--tokenizer", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=6000, help="upper bound; --minutes usually ends it first")
    parser.add_argument("--minutes", type=float, default=7.0, help="training time budget (the schedule anneals within it)")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--seq", type=int, default=SEQ_LEN)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--warmup", type=int, default=200)
    parser.add_argument("--weight-decay", type=float, default=0.1)
    parser.add_argument("--bias-rate", type=float, default=1e-3)
    parser.add_argument("--eval-every", type=int, default=250)
    parser.add_argument("--heldout-tokens", type=int, default=4_000_000, help="for the final perplexity")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()

    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    vocab = json.loads((args.tokenizer / "tokenizer.json").read_text())["model"]["vocab"]
    raw = target_config(len(vocab))
    cfg = TargetConfig.from_dict(raw)
    model = init_target(cfg, device, dtype, args.seed)
    use_dense_moe(model)  # the same function as the engine's grouped-GEMM MoE, with a plain backward
    params = sum(p.numel() for p in model.parameters())
    train = TokenWindows(args.data / "train.npy", args.seq, seed=args.seed)
    held = TokenWindows(args.data / "heldout.npy", args.seq, seed=args.seed + 1)
    balance = RouterBalance(model, args.bias_rate)  # first: it takes the biases out of the optimizer
    opt = MasterAdamW(model.parameters(), args.lr, args.weight_decay)
    schedule = Schedule(args.lr, args.steps, args.minutes * 60, args.warmup)
    log = {"args": {k: str(v) for k, v in vars(args).items()}, "config": raw, "parameters": params,
           "train_tokens_available": len(train), "environment": environment(), "train": [], "heldout": []}
    print(f"target: {params / 1e6:.2f} M parameters, {len(train) / 1e6:.1f} M training tokens, device {device}")

    model.train()
    step, tokens, start = 0, 0, time.time()
    bar = tqdm(total=100, desc="target", unit="%", bar_format="{l_bar}{bar}| {n:.0f}/100% [{elapsed}<{remaining}{postfix}]", mininterval=20)
    while step < args.steps and schedule.progress(step) < 1.0:
        rows = train.batch(args.batch, device)
        logits, _ = model(rows[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), rows[:, 1:].flatten())
        loss.backward()
        lr = schedule(step)
        norm = opt.step(lr)
        imbalance = balance.update()
        step += 1
        tokens += rows[:, 1:].numel()
        if step % 10 == 0 or step == 1:
            value = float(loss.detach())
            log["train"].append({"step": step, "tokens": tokens, "loss": value, "lr": lr, "grad_norm": norm,
                                 "max_over_mean_expert_load": imbalance, "seconds": time.time() - start})
            bar.n = min(100.0, 100 * schedule.progress(step))
            bar.set_postfix(loss=f"{value:.3f}", tok_s=f"{tokens / (time.time() - start):,.0f}")
        if step % args.eval_every == 0:
            model.eval()
            value, _ = heldout_loss(model, held, args.batch, 256 * args.seq, device)
            balance.reset()  # evaluation routing is not a training load
            model.train()
            log["heldout"].append({"step": step, "tokens": tokens, "loss": value})
    bar.close()
    elapsed = time.time() - start
    model.eval()
    value, counted = heldout_loss(model, held, args.batch, args.heldout_tokens, device)
    log["heldout"].append({"step": step, "tokens": tokens, "loss": value})
    log["final"] = {"steps": step, "tokens": tokens, "seconds": elapsed, "tokens_per_s": tokens / elapsed,
                    "heldout_loss": value, "heldout_perplexity": math.exp(value), "heldout_tokens": counted}
    print(f"target: {step} steps, {tokens / 1e6:.1f} M tokens in {elapsed:.0f} s; held-out perplexity "
          f"{math.exp(value):.3f} over {counted:,} tokens")

    save_target(model, raw, args.out, dtype=torch.bfloat16)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (args.tokenizer / name).is_file():
            shutil.copy(args.tokenizer / name, args.out / name)
    (args.out / "generation_config.json").write_text(json.dumps({"bos_token_id": EOT_ID, "eos_token_id": EOT_ID}))
    write_log(log, args.out.parent / "target_log.json")
    plot_losses(log, args.out.parent / "target_loss.png", f"demo target ({params / 1e6:.1f} M parameters)")


if __name__ == "__main__":
    main()
