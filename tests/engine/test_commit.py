"""The commit's gather-then-scatter against the entry-by-entry reference, on shuffled pages,
overlapping moves, paths of every length and inactive requests; nothing outside the moved
slots changes."""

import torch

from ddtree.engine.commit import commit_reference, commit_slots, move_entries
from ddtree.tree import accept_paths, build_trees, topk_logprobs

PAGE = 4


def _case(seed: int):
    gen = torch.Generator().manual_seed(seed)
    batch, depth, budget = 5, 6, 12
    lp, tok = topk_logprobs(torch.randn(batch, depth, 10, generator=gen) * 3, 4)  # peaked: deep trees
    trees = build_trees(lp, tok, budget, backend="reference")
    posterior = torch.randint(0, 10, (batch, budget + 1), generator=gen)
    for b in range(batch):  # steer request b along the path to its deepest node, b steps long
        n = int(trees.num_nodes[b])
        deepest = max(range(1, n + 1), key=lambda i: (int(trees.depths[b, i - 1]), i))
        path = [deepest]
        while int(trees.parents[b, path[-1] - 1]):
            path.append(int(trees.parents[b, path[-1] - 1]))
        node = 0
        for child in path[::-1][:b]:
            posterior[b, node] = trees.tokens[b, child - 1]
            node = child
        posterior[b, node] = -1  # stop there: no token matches
    accepted, accept_len, _ = accept_paths(trees, posterior, backend="reference")
    prefix = torch.randint(0, 9, (batch,), generator=gen).int()
    pages_each = -(-(int(prefix.max()) + budget + 1) // PAGE)
    order = torch.randperm(batch * pages_each + 2, generator=gen)
    table = order[: batch * pages_each].view(batch, pages_each).int()
    caches = [torch.randn(batch * pages_each + 3, PAGE, 8, generator=gen) for _ in range(2)]  # last page: scratch
    active = torch.tensor([True, True, False, True, True])
    return caches, table, prefix, accepted, accept_len, active


def test_commit_matches_the_reference():
    for seed in range(6):
        caches, table, prefix, accepted, accept_len, active = _case(seed)
        assert accept_len.max() >= 4, seed  # the steering reaches deep paths
        want = [c.clone() for c in caches]
        commit_reference(want, table, prefix, accepted, accept_len, active)
        src, dst = commit_slots(table, prefix, accepted, accept_len, active, PAGE, scratch_page=caches[0].shape[0] - 1)
        move_entries(caches, src, dst)
        for got, ref in zip(caches, want):
            assert torch.equal(got[:-1], ref[:-1]), seed  # every request page, untouched ones included


def test_inactive_and_short_paths_move_nothing():
    caches, table, prefix, accepted, accept_len, active = _case(7)
    before = [c.clone() for c in caches]
    src, dst = commit_slots(table, prefix, accepted, torch.ones_like(accept_len), active, PAGE, caches[0].shape[0] - 1)
    move_entries(caches, src, dst)
    for got, ref in zip(caches, before):
        assert torch.equal(got[:-1], ref[:-1])
