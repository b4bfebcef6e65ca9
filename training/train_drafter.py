"""Train the demo pair's DFlash drafter on the frozen demo target's own hidden features.

    python -m training.train_drafter --target OUT/target --data DATA --out OUT/drafter --minutes 7

The DFlash recipe: in each training window, anchors are sampled; the block after each anchor is
masked and all its positions are predicted in one non-causal pass conditioned on the target's
features of the tokens before the anchor (training/dflash.py); the loss is the cross-entropy
against the target's own next-token distributions, decayed with the position in the block
(exp(-(j - 1) / gamma)). Embeddings and lm_head are the target's and stay frozen.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from tqdm import tqdm

from ddtree.models import Drafter, DrafterConfig, load_target, save_drafter
from training.data import TokenWindows
from training.demo_config import SEQ_LEN, drafter_config
from training.dflash import distill_loss, draft_block_logits, position_weights, sample_anchors, teacher_for_blocks
from training.loop import MasterAdamW, Schedule, environment, plot_losses, write_log


def init_drafter(cfg: DrafterConfig, device, dtype, seed: int) -> Drafter:
    torch.manual_seed(seed)
    model = Drafter(cfg).to(device)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02)
    return model.to(dtype)


def block_losses(drafter, target, ids, anchors, weights):
    """The distillation loss for the blocks at anchors, and per slot whether the drafter's argmax
    equals the target's (teacher-forced) argmax: bool [B, K, S - 1]."""
    with torch.no_grad():
        logits, feats = target(ids, hidden_layers=drafter.cfg.target_layer_ids)
        teacher = teacher_for_blocks(logits, anchors, drafter.cfg.block_size)
    student = draft_block_logits(drafter, target, ids, torch.cat(feats, -1), anchors)
    agree = student.argmax(-1) == teacher.argmax(-1)
    return distill_loss(student, teacher, weights), agree


def acceptance_proxy(agree: torch.Tensor) -> tuple[float, list[float]]:
    """From agreement [B, K, S - 1]: mean (1 + leading agreeing slots), a chain's acceptance length
    on teacher-forced text, and the agreement rate per slot."""
    leading = agree.long().cumprod(-1).sum(-1)
    return 1.0 + float(leading.float().mean()), agree.float().mean((0, 1)).tolist()


@torch.no_grad()
def heldout_eval(drafter, target, windows, batch, anchors_per_window, weights, limit_tokens, device) -> dict:
    gen = torch.Generator().manual_seed(1234)  # the same anchors at every evaluation
    losses, agrees = [], []
    for rows in windows.ordered(batch, limit_tokens, device):
        ids = rows[:, :-1]
        anchors = sample_anchors(ids.shape[0], anchors_per_window, ids.shape[1], drafter.cfg.block_size, gen, device)
        loss, agree = block_losses(drafter, target, ids, anchors, weights)
        losses.append(float(loss))
        agrees.append(agree)
    tau, per_slot = acceptance_proxy(torch.cat(agrees))
    return {"loss": sum(losses) / len(losses), "chain_acceptance_proxy": tau, "slot_agreement": per_slot}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", type=Path, required=True, help="the trained target's checkpoint directory")
    parser.add_argument("--data", type=Path, required=True, help="directory with train.npy / heldout.npy")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=8000, help="upper bound; --minutes usually ends it first")
    parser.add_argument("--minutes", type=float, default=7.0)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--seq", type=int, default=SEQ_LEN)
    parser.add_argument("--anchors", type=int, default=64, help="blocks per training window")
    parser.add_argument("--gamma", type=float, default=7.0, help="loss decay over the block (DFlash uses 7 for block 16)")
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--warmup", type=int, default=200)
    parser.add_argument("--weight-decay", type=float, default=0.05)
    parser.add_argument("--eval-every", type=int, default=500)
    parser.add_argument("--heldout-tokens", type=int, default=1_000_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()

    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    target = load_target(args.target, dtype=dtype, device=device)
    target.requires_grad_(False)
    raw = drafter_config(target.cfg.vocab_size)
    cfg = DrafterConfig.from_dict(raw)
    drafter = init_drafter(cfg, device, dtype, args.seed)
    params = sum(p.numel() for p in drafter.parameters())
    train = TokenWindows(args.data / "train.npy", args.seq, seed=args.seed + 10)
    held = TokenWindows(args.data / "heldout.npy", args.seq, seed=args.seed + 11)
    weights = position_weights(cfg.block_size, args.gamma, device)
    opt = MasterAdamW(drafter.parameters(), args.lr, args.weight_decay)
    schedule = Schedule(args.lr, args.steps, args.minutes * 60, args.warmup)
    anchor_gen = torch.Generator().manual_seed(args.seed)
    log = {"args": {k: str(v) for k, v in vars(args).items()}, "config": raw, "parameters": params,
           "environment": environment(), "loss_name": "position-weighted cross-entropy vs the target (nats)",
           "train": [], "heldout": []}
    print(f"drafter: {params / 1e6:.2f} M parameters, block {cfg.block_size}, target layers {cfg.target_layer_ids}")

    step, tokens, start = 0, 0, time.time()
    bar = tqdm(total=100, desc="drafter", unit="%", bar_format="{l_bar}{bar}| {n:.0f}/100% [{elapsed}<{remaining}{postfix}]", mininterval=20)
    while step < args.steps and schedule.progress(step) < 1.0:
        ids = train.batch(args.batch, device)[:, :-1]
        anchors = sample_anchors(args.batch, args.anchors, args.seq, cfg.block_size, anchor_gen, device)
        loss, agree = block_losses(drafter, target, ids, anchors, weights)
        loss.backward()
        lr = schedule(step)
        norm = opt.step(lr)
        step += 1
        tokens += ids.numel()
        if step % 10 == 0 or step == 1:
            tau, _ = acceptance_proxy(agree)
            value = float(loss.detach())
            log["train"].append({"step": step, "tokens": tokens, "loss": value, "lr": lr, "grad_norm": norm,
                                 "chain_acceptance_proxy": tau, "seconds": time.time() - start})
            bar.n = min(100.0, 100 * schedule.progress(step))
            bar.set_postfix(loss=f"{value:.3f}", tau=f"{tau:.2f}")
        if step % args.eval_every == 0:
            drafter.eval()
            log["heldout"].append({"step": step, "tokens": tokens,
                                   **heldout_eval(drafter, target, held, args.batch, args.anchors, weights, 128 * args.seq, device)})
            drafter.train()
    bar.close()
    elapsed = time.time() - start
    drafter.eval()
    final = heldout_eval(drafter, target, held, args.batch, args.anchors, weights, args.heldout_tokens, device)
    log["heldout"].append({"step": step, "tokens": tokens, **final})
    log["final"] = {"steps": step, "tokens": tokens, "seconds": elapsed, **final}
    print(f"drafter: {step} steps in {elapsed:.0f} s; held-out loss {final['loss']:.3f}, chain acceptance proxy "
          f"{final['chain_acceptance_proxy']:.2f} (teacher-forced), slot agreement "
          + " ".join(f"{a:.2f}" for a in final["slot_agreement"]))
    save_drafter(drafter, raw, args.out, dtype=torch.bfloat16)
    write_log(log, args.out.parent / "drafter_log.json")
    plot_losses(log, args.out.parent / "drafter_loss.png", f"demo DFlash drafter ({params / 1e6:.1f} M parameters)")


if __name__ == "__main__":
    main()
