"""ddtree: DDTree speculative decoding for MLA mixture-of-experts targets."""

__version__ = "0.1.0"
