"""Draft-tree stage of a DDTree round: top-k, best-first tree build, accept walk."""

from .api import BACKENDS, accept_paths, build_trees
from .topk import topk_logprobs
from .types import PAD, TREE_FIELDS, DraftTrees, empty_trees, pack_visibility

__all__ = ["BACKENDS", "PAD", "TREE_FIELDS", "DraftTrees", "accept_paths", "build_trees", "empty_trees",
           "pack_visibility", "topk_logprobs"]
