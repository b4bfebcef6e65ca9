"""Target (DeepSeek-V3 / Kimi K2 family) model in PyTorch, loaded from Hugging Face checkpoints."""

from .config import TargetConfig
from .loader import load_target
from .target import Target

__all__ = ["Target", "TargetConfig", "load_target"]
