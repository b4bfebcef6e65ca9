"""Target (DeepSeek-V3 / Kimi K2 family) and DFlash drafter in PyTorch, from Hugging Face checkpoints."""

from .config import TargetConfig
from .drafter import Drafter, DrafterCache, DrafterConfig, check_pair
from .loader import load_drafter, load_target, random_target
from .saving import save_drafter, save_target
from .paged import ForwardMeta
from .paged_prefill import PrefillMeta
from .target import Target

__all__ = [
    "Drafter", "DrafterCache", "DrafterConfig", "ForwardMeta", "PrefillMeta", "Target", "TargetConfig",
    "check_pair", "load_drafter", "load_target", "random_target", "save_drafter", "save_target",
]
