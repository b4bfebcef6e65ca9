"""What both training scripts share: bf16 weights with float32 master copies under AdamW, a
warm-up + cosine schedule over a step or time budget, the loss-curve plot and the run log."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import torch


class MasterAdamW:
    """The model computes in its own dtype (bf16 on the GPU, as the engine serves it); AdamW steps
    float32 master copies and writes them back, so small updates are not rounded away."""

    def __init__(self, params, lr: float, weight_decay: float, betas=(0.9, 0.95)):
        self.params = [p for p in params if p.requires_grad]
        self.master = [p.detach().float().clone().requires_grad_(True) for p in self.params]
        decay = [m for m, p in zip(self.master, self.params) if p.ndim >= 2]
        plain = [m for m, p in zip(self.master, self.params) if p.ndim < 2]  # norms: no decay
        fused = self.params[0].is_cuda
        self.opt = torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay},
                                      {"params": plain, "weight_decay": 0.0}], lr=lr, betas=betas, fused=fused)

    def step(self, lr: float, clip: float = 1.0) -> float:
        """Copy grads to the masters, clip their global norm, step, copy back; returns the norm.
        A parameter without a gradient this step is neither stepped nor overwritten."""
        stepped = []
        for m, p in zip(self.master, self.params):
            m.grad = None if p.grad is None else p.grad.float()
            if p.grad is not None:
                stepped.append((m, p))
            p.grad = None
        norm = torch.nn.utils.clip_grad_norm_(self.master, clip)
        for group in self.opt.param_groups:
            group["lr"] = lr
        self.opt.step()
        with torch.no_grad():
            for m, p in stepped:
                p.copy_(m)
        return float(norm)


class Schedule:
    """Linear warm-up, then cosine to min_ratio; progress is the larger of steps done / steps and
    seconds spent / seconds allowed, so a slower machine anneals fully inside its time budget."""

    def __init__(self, lr: float, steps: int, seconds: float, warmup: int, min_ratio: float = 0.1):
        self.lr, self.steps, self.seconds, self.warmup, self.min_ratio = lr, steps, seconds, warmup, min_ratio
        self.start = time.time()

    def progress(self, step: int) -> float:
        return max(step / self.steps, (time.time() - self.start) / self.seconds)

    def __call__(self, step: int) -> float:
        if step < self.warmup:
            return self.lr * (step + 1) / self.warmup
        cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, self.progress(step))))
        return self.lr * (self.min_ratio + (1 - self.min_ratio) * cosine)


def plot_losses(log: dict, path: Path, title: str) -> None:
    """Training loss (smoothed) and held-out loss against tokens seen, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    steps = log["train"]
    if steps:
        xs = [s["tokens"] / 1e6 for s in steps]
        ys = [s["loss"] for s in steps]
        smooth, acc = [], None
        for y in ys:
            acc = y if acc is None else 0.95 * acc + 0.05 * y
            smooth.append(acc)
        ax.plot(xs, ys, color="tab:blue", alpha=0.25, linewidth=0.8)
        ax.plot(xs, smooth, color="tab:blue", label="training (EMA 0.95)")
    if log["heldout"]:
        ax.plot([s["tokens"] / 1e6 for s in log["heldout"]], [s["loss"] for s in log["heldout"]], "o-",
                color="tab:orange", label="held-out")
    ax.set_xlabel("training tokens (millions)")
    ax.set_ylabel(log.get("loss_name", "loss (nats / token)"))
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_log(log: dict, path: Path) -> None:
    path.write_text(json.dumps(log, indent=1))


def environment() -> dict:
    """Library versions and the device, for the run log."""
    import platform

    import numpy

    try:
        import triton
        triton_version = triton.__version__
    except ImportError:  # not installed off Linux
        triton_version = None
    return {"python": platform.python_version(), "torch": torch.__version__, "triton": triton_version,
            "numpy": numpy.__version__,
            "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"}
