"""Reference draft-tree builder and accept walk: plain Python, the readable specification.

The GPU kernels in build_triton.py / accept_triton.py must return exactly what these return.
"""

from __future__ import annotations

import heapq
import math

import torch

from .types import PAD, DraftTrees, visibility_words


def build_tree_one(logprobs: list[list[float]], budget: int) -> list[tuple[int, int, int]]:
    """Best-first selection of up to `budget` nodes for one request.

    logprobs: D rows of K float32 log-probs (as Python floats), each sorted descending.
    Returns the popped nodes in pop order as (depth, rank, parent); node i is entry i - 1.

    Heap key: (-logw, rank_path), rank_path being the tuple of top-k ranks from depth 1, so equal
    weights pop in lexicographic path order (a prefix first). logw is a float64 accumulated as
    documented in docs/architecture.md. A candidate whose own log-prob is -inf (probability 0)
    is never pushed, which keeps every weight finite.
    """
    depth_max, k = len(logprobs), len(logprobs[0])
    heap: list[tuple[float, tuple[int, ...], int, int, int]] = []
    if logprobs[0][0] > -math.inf:
        heap.append((-logprobs[0][0], (0,), 1, 0, 0))  # (-logw, rank_path, depth, rank, parent)
    nodes: list[tuple[int, int, int]] = []
    while heap and len(nodes) < budget:
        neg_w, path, depth, rank, parent = heapq.heappop(heap)
        w = -neg_w
        nodes.append((depth, rank, parent))
        node = len(nodes)
        row = logprobs[depth - 1]
        if rank + 1 < k and row[rank + 1] > -math.inf:
            sibling_w = w - row[rank] + row[rank + 1]
            heapq.heappush(heap, (-sibling_w, path[:-1] + (rank + 1,), depth, rank + 1, parent))
        if depth < depth_max and logprobs[depth][0] > -math.inf:
            child_w = w + logprobs[depth][0]
            heapq.heappush(heap, (-child_w, path + (0,), depth + 1, 0, node))
    return nodes


def visibility_rows(parents: list[int], budget: int) -> list[list[int]]:
    """Packed ancestor bitmask rows [budget + 1][words] as signed int64 values.

    parents[i - 1] is node i's parent; row i has bits for i and all its ancestors (root included).
    """
    words = visibility_words(budget)
    rows = [[0] * words for _ in range(budget + 1)]
    ancestors: list[set[int]] = [{0}]
    for i, p in enumerate(parents, start=1):
        ancestors.append(ancestors[p] | {i})
    for i, anc in enumerate(ancestors):
        for j in anc:
            rows[i][j // 64] |= 1 << (j % 64)
    # Reinterpret as two's-complement int64 (bit 63 is the sign bit).
    return [[v - (1 << 64) if v >= 1 << 63 else v for v in row] for row in rows]


def build_trees_reference(top_logprobs: torch.Tensor, top_tokens: torch.Tensor, budget: int) -> DraftTrees:
    """Reference builder: top_logprobs float32 [B, D, K], top_tokens int64 [B, D, K] -> DraftTrees.

    Uses the first min(K, budget) ranks. Runs on the CPU; results go back to the inputs' device.
    """
    device = top_logprobs.device
    b, depth_max, k = top_logprobs.shape
    k_used = min(k, budget)
    lp_all = top_logprobs[..., :k_used].detach().cpu().double().tolist()
    tok_all = top_tokens[..., :k_used].detach().cpu().tolist()
    tokens = torch.full((b, budget), PAD, dtype=torch.int64)
    parents = torch.full((b, budget), PAD, dtype=torch.int64)
    depths = torch.full((b, budget), PAD, dtype=torch.int64)
    num_nodes = torch.zeros(b, dtype=torch.int64)
    visibility = torch.zeros((b, budget + 1, visibility_words(budget)), dtype=torch.int64)
    for r in range(b):
        nodes = build_tree_one(lp_all[r], budget)
        n = len(nodes)
        num_nodes[r] = n
        if n:
            tokens[r, :n] = torch.tensor([tok_all[r][d - 1][rank] for d, rank, _ in nodes])
            depths[r, :n] = torch.tensor([d for d, _, _ in nodes])
            parents[r, :n] = torch.tensor([p for _, _, p in nodes])
        visibility[r, : n + 1] = torch.tensor(visibility_rows([p for _, _, p in nodes], budget)[: n + 1])
    return DraftTrees(
        tokens=tokens.to(device),
        parents=parents.to(device),
        depths=depths.to(device),
        num_nodes=num_nodes.to(device),
        visibility=visibility.to(device),
        max_depth=depth_max,
    )


def accept_paths_reference(trees: DraftTrees, posterior: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Reference accept walk.

    posterior: int [B, budget + 1], the target's chosen token after each node (column 0 = root).
    From the root, move to the child whose token equals the target's choice at the current node
    (the lowest-numbered such child if a malformed tree repeats a token); stop when none matches.
    Returns accepted int64 [B, D + 1] (node indices from the root, PAD after), accept_len int64 [B]
    (root included, so >= 1) and bonus int64 [B] (the target's token at the last accepted node).
    """
    device = posterior.device
    b = trees.batch_size
    tokens = trees.tokens.cpu().tolist()
    parents = trees.parents.cpu().tolist()
    num_nodes = trees.num_nodes.cpu().tolist()
    post = posterior.cpu().long().tolist()
    accepted = torch.full((b, trees.max_depth + 1), PAD, dtype=torch.int64)
    accept_len = torch.zeros(b, dtype=torch.int64)
    bonus = torch.zeros(b, dtype=torch.int64)
    for r in range(b):
        path = [0]
        while len(path) <= trees.max_depth:
            cur = path[-1]
            target = post[r][cur]
            child = next(
                (i for i in range(1, num_nodes[r] + 1) if parents[r][i - 1] == cur and tokens[r][i - 1] == target),
                None,
            )
            if child is None:
                break
            path.append(child)
        accepted[r, : len(path)] = torch.tensor(path)
        accept_len[r] = len(path)
        bonus[r] = post[r][path[-1]]
    return accepted.to(device), accept_len.to(device), bonus.to(device)
