"""The commit's moves (PyTorch's gather-then-scatter and ops/cache_moves.py's one launch, which
finds the slots itself) against the entry-by-entry reference, on shuffled pages, overlapping moves,
paths of every length and inactive requests; nothing outside the moved slots changes."""

import sys

import pytest
import torch

from ddtree.engine.commit import commit, commit_reference
from ddtree.ops import KERNELS, REFERENCE, cache_moves
from ddtree.tree import accept_paths, build_trees, topk_logprobs

PAGE = 4


def _case(seed: int, device: str = "cpu"):
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
    # views of one tensor, as Target.new_cache makes them; the last page is the scratch page
    caches = list(torch.randn(3, batch * pages_each + 3, PAGE, 24, generator=gen).to(device).unbind(0))
    active = torch.tensor([True, True, False, True, True])
    on = lambda *ts: [t.to(device) for t in ts]  # noqa: E731
    return (caches, *on(table, prefix, accepted, accept_len, active))


# both paths: the kernel's where kernels run (CUDA, or the interpreter on the CPU)
PATHS = [pytest.param(REFERENCE, id="reference"), pytest.param(KERNELS, id="kernel")]


@pytest.mark.parametrize("policy", PATHS)
def test_commit_matches_the_reference(policy, kernel_device):
    for seed in range(6):
        caches, table, prefix, accepted, accept_len, active = _case(seed, kernel_device)
        assert accept_len.max() >= 4, seed  # the steering reaches deep paths
        want = [c.clone() for c in caches]
        commit_reference(want, table, prefix, accepted, accept_len, active)
        commit(caches, table, prefix, accepted, accept_len, active, PAGE, caches[0].shape[0] - 1, policy)
        for got, ref in zip(caches, want):
            assert torch.equal(got[:-1], ref[:-1]), seed  # every request page, untouched ones included


@pytest.mark.parametrize("policy", PATHS)
def test_inactive_and_short_paths_move_nothing(policy, kernel_device):
    caches, table, prefix, accepted, accept_len, active = _case(7, kernel_device)
    before = [c.clone() for c in caches]
    commit(caches, table, prefix, accepted, torch.ones_like(accept_len), active, PAGE, caches[0].shape[0] - 1, policy)
    for got, ref in zip(caches, before):
        assert torch.equal(got[:-1], ref[:-1])


def test_the_one_launch_needs_one_tensors_views_and_named_inputs(kernel_device, monkeypatch):
    caches, table, prefix, accepted, accept_len, active = _case(3, kernel_device)
    apart = [c.clone() for c in caches]  # separate tensors: no layer stride
    assert cache_moves.layer_stride(caches) == caches[0].numel() and cache_moves.layer_stride(apart) is None
    flat = caches[0].new_zeros(4 * caches[0].numel())
    overlapping = [flat[i * 8: i * 8 + caches[0].numel()].view_as(caches[0]) for i in range(3)]
    assert cache_moves.layer_stride(overlapping) is None
    with pytest.raises(ValueError, match="views of one tensor"):
        cache_moves.commit_moves(apart, table, prefix, accepted, accept_len, active)
    with pytest.raises(ValueError, match="prefix_lens must be torch.int32"):
        cache_moves.commit_moves(caches, table, prefix.long(), accepted, accept_len, active)
    with pytest.raises(ValueError, match="accept_len must be torch.int64 with 1 dims, 5 rows"):
        cache_moves.commit_moves(caches, table, prefix, accepted, accept_len[:4], active)
    # the engine's commit keeps separate caches on the PyTorch path rather than refusing them
    monkeypatch.setattr(cache_moves, "commit_moves", lambda *a, **k: pytest.fail("one launch over separate caches"))
    want = [c.clone() for c in apart]
    commit_reference(want, table, prefix, accepted, accept_len, active)
    commit(apart, table, prefix, accepted, accept_len, active, PAGE, caches[0].shape[0] - 1, KERNELS)
    for got, ref in zip(apart, want):
        assert torch.equal(got[:-1], ref[:-1])


def test_a_page_missing_from_the_table_is_never_written(kernel_device):
    """A path step whose page the table lacks (-1, which the engine never leaves there) moves
    nothing rather than write through a wrong page."""
    caches, table, prefix, accepted, accept_len, active = _case(4, kernel_device)
    b = int(accept_len.argmax())
    table[b] = -1
    want = [c.clone() for c in caches]
    keep = active.clone()
    keep[b] = False
    commit_reference(want, table, prefix, accepted, accept_len, keep)
    cache_moves.commit_moves(caches, table, prefix, accepted, accept_len, active)
    for got, ref in zip(caches, want):
        assert torch.equal(got, ref)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Triton's CUDA toolchain ships for Linux")
def test_the_commit_kernel_compiles_for_sm90_and_waits_for_its_producer_first():
    from ..sm90_assembly import compiled_in_fresh_interpreter

    report = compiled_in_fresh_interpreter(
        "import json; from tests.ops.fused_moe_compile import compile_report; from ddtree.ops import cache_moves; "
        "print(json.dumps(compile_report(cache_moves._commit_kernel, dict(cache_ptr='*bf16', table_ptr='*i32', "
        "prefix_ptr='*i32', accepted_ptr='*i64', accept_len_ptr='*i64', active_ptr='*i1'), dict(BLOCK_W=256), "
        "num_warps=4, not_divisible=('depth', 'table_width', 'stride_table', 'stride_accepted'))))")
    assert report["spill_bytes"] == 0 and report["pdl_waits"] >= 1 and report["waits_first"], report
