"""The demo pair shipped inside the package: a small Kimi-K2-architecture Python coder (target,
with its tokenizer) and its DFlash drafter, trained by the scripts under training/.

It is what `ddtree generate "def f(x):"` and `Engine.from_pretrained()` load when no checkpoint is
named: a demonstration that DDTree accepts several tokens a round, not a general assistant.
"""

from __future__ import annotations

from pathlib import Path

DEMO_DIR = Path(__file__).resolve().parent
TARGET_DIR = DEMO_DIR / "target"
DRAFTER_DIR = DEMO_DIR / "drafter"


def demo_pair() -> tuple[Path, Path]:
    """(target_dir, drafter_dir) of the shipped demo pair; FileNotFoundError when this install lacks it."""
    for path in (TARGET_DIR, DRAFTER_DIR):
        if not (path / "config.json").is_file():
            raise FileNotFoundError(
                f"the demo pair is not in this install ({path} has no config.json): "
                "pass --target DIR --drafter DIR (Engine.from_pretrained(target_dir, drafter_dir))")
    return TARGET_DIR, DRAFTER_DIR
