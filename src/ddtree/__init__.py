"""ddtree: DDTree speculative decoding for MLA mixture-of-experts targets."""

__version__ = "0.1.0"

from .engine import Engine, SamplingParams  # noqa: E402

__all__ = ["Engine", "SamplingParams", "__version__"]
