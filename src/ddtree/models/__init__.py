"""Target (DeepSeek-V3 / Kimi K2 family) and DFlash drafter in PyTorch, from Hugging Face checkpoints."""

from .checkpoint import load_drafter, load_target, random_target, save_drafter, save_target
from .config import TargetConfig
from .drafter import Drafter, DrafterCache
from .drafter_config import DrafterConfig, check_pair
from .paged import ForwardMeta, PrefillMeta
from .target import Target

__all__ = [
    "Drafter", "DrafterCache", "DrafterConfig", "ForwardMeta", "PrefillMeta", "Target", "TargetConfig",
    "check_pair", "load_drafter", "load_target", "random_target", "save_drafter", "save_target",
]
