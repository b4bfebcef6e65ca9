"""The DDTree engine: paged KV, batched rounds, lossless greedy and sampled verification."""

from .engine import Engine
from .pages import BlockManager, KVCacheFull, PageAllocator
from .request import GenerationStats, RequestOutput, StepOutput
from .sampling import SamplingParams

__all__ = ["BlockManager", "Engine", "GenerationStats", "KVCacheFull", "PageAllocator", "RequestOutput",
           "SamplingParams", "StepOutput"]
