"""Draft-tree stage of a DDTree round: top-k, best-first tree build, accept walk."""

from .api import BACKENDS, accept_paths, build_trees
from .topk import topk_logprobs
from .types import PAD, DraftTrees

__all__ = ["BACKENDS", "PAD", "DraftTrees", "accept_paths", "build_trees", "topk_logprobs"]
