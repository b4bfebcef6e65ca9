"""Tree-verify MLA attention over a paged latent KV cache (absorbed form)."""

from .api import choose_num_splits, tree_verify_mla
from .reference import tree_verify_mla_reference

__all__ = ["choose_num_splits", "tree_verify_mla", "tree_verify_mla_reference"]
