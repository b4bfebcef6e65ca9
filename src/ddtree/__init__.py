"""ddtree: DDTree speculative decoding for MLA mixture-of-experts targets."""

from .version import __version__

__all__ = ["Engine", "SamplingParams", "__version__"]


def __getattr__(name: str):
    # Engine and SamplingParams import torch: `ddtree --version` and `--help` need neither
    if name in ("Engine", "SamplingParams"):
        from . import engine

        return getattr(engine, name)
    raise AttributeError(f"module 'ddtree' has no attribute {name!r}")
