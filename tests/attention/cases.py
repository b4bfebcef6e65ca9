"""Inputs for the tree-verify attention tests: paged caches with shuffled pages, NaN-poisoned
unused pages and slots, trees from the real builder or chains, ragged batches."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ddtree.tree import build_trees, pack_visibility, topk_logprobs


@dataclass
class Case:
    heads: int
    prefixes: list[int]  # one per request
    tree_rows: list[int]  # valid rows (root + nodes) per request, <= rows
    rows: int  # N
    page_size: int = 16
    chain: bool = False
    dtype: torch.dtype = torch.bfloat16
    seed: int = 0


def chain_visibility(tree_rows: list[int], rows: int) -> torch.Tensor:
    """Row n sees rows 0..n; rows past each request's tree_rows are zero, as the builder leaves them."""
    seen = torch.ones(rows, rows, dtype=torch.bool).tril().expand(len(tree_rows), rows, rows).clone()
    for b, n in enumerate(tree_rows):
        seen[b, n:] = False
    return pack_visibility(seen)


def tree_visibility(tree_rows: list[int], rows: int, gen: torch.Generator) -> torch.Tensor:
    """Each request's bitmask from the builder: a tree of tree_rows[b] - 1 nodes (budget N - 1)."""
    batch, budget = len(tree_rows), rows - 1
    vis = torch.zeros(batch, rows, (rows + 63) // 64, dtype=torch.int64)
    for b, n in enumerate(tree_rows):
        if budget == 0 or n <= 1:
            vis[b, 0, 0] = 1
            continue
        lp, tok = topk_logprobs(torch.randn(1, 6, 40, generator=gen) * 2, min(8, budget))
        trees = build_trees(lp, tok, n - 1, backend="reference")  # exactly n - 1 nodes here
        assert int(trees.num_nodes[0]) == n - 1
        words = trees.visibility.shape[2]
        vis[b, :n, :words] = trees.visibility[0, :n]
    return vis


def make_inputs(case: Case, device: str):
    """(q, kv_cache, block_table, prefix_lens, num_rows, visibility) on `device`."""
    gen = torch.Generator().manual_seed(case.seed)
    batch = len(case.prefixes)
    lengths = [p + case.rows for p in case.prefixes]
    pages = [(n + case.page_size - 1) // case.page_size for n in lengths]
    max_pages = max(pages) + 1
    num_pages = sum(pages) + 3  # spare pages stay NaN: a stray read shows
    kv = torch.full((num_pages, case.page_size, 576), float("nan"))
    order = torch.randperm(num_pages, generator=gen)
    block_table = torch.full((batch, max_pages), -1, dtype=torch.int32)
    used = 0
    for b in range(batch):
        ids = order[used : used + pages[b]]
        used += pages[b]
        block_table[b, : pages[b]] = ids.int()
        valid = case.prefixes[b] + case.tree_rows[b]  # slots past this stay NaN (padding rows)
        for slot in range(valid):
            kv[ids[slot // case.page_size], slot % case.page_size] = torch.randn(576, generator=gen)
    q = torch.randn(batch, case.rows, case.heads, 576, generator=gen)
    for b in range(batch):
        q[b, case.tree_rows[b] :] = float("nan")  # padding rows' queries are never used
    if case.chain:
        vis = chain_visibility(case.tree_rows, case.rows)
    else:
        vis = tree_visibility(case.tree_rows, case.rows, gen)
    prefix_lens = torch.tensor(case.prefixes, dtype=torch.int32)
    num_rows = torch.tensor(case.tree_rows, dtype=torch.int32)
    tensors = (q.to(case.dtype), kv.to(case.dtype), block_table, prefix_lens, num_rows, vis)
    return tuple(t.to(device) for t in tensors)
