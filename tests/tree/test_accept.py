"""accept_paths: the walk along the target's choices, reference vs Triton, and bad input."""

import pytest
import torch

from ddtree.tree import accept_paths, build_trees

from .helpers import make_draft, path_posterior, with_zero_probability


def test_hand_worked_walk(kernel_device):
    lp = torch.tensor([[[-0.125, -2.0], [-0.5, -1.0]]]).expand(3, 2, 2).contiguous()
    tok = torch.tensor([[[10, 11], [20, 21]]]).expand(3, 2, 2).contiguous()
    trees = build_trees(lp, tok, 4, backend="reference")  # nodes: 1=10, 2=10>20, 3=10>21, 4=11
    post = torch.tensor(
        [
            [10, 21, 7, 8, 9],  # root->1 (10), node 1->3 (21), node 3: depth 2 = D, stop
            [11, 0, 0, 0, 5],  # root->4 (11), node 4 has no children: bonus post[4] = 5
            [12, 0, 0, 0, 0],  # no child matches: only the root, bonus 12
        ]
    )
    for backend, device in (("reference", "cpu"), ("triton", kernel_device)):
        accepted, accept_len, bonus = accept_paths(trees.to(device), post.to(device), backend=backend)
        assert accepted.tolist() == [[0, 1, 3], [0, 4, -1], [0, -1, -1]]
        assert accept_len.tolist() == [3, 2, 1]
        assert bonus.tolist() == [8, 5, 12]


@pytest.mark.parametrize("kind,b,d,k,budget", [("bf16", 4, 6, 6, 30), ("integer", 3, 4, 3, 40), ("normal", 5, 8, 1, 8)])
def test_triton_matches_reference(kind, b, d, k, budget, kernel_device):
    gen = torch.Generator().manual_seed(b * d)
    lp, tok = make_draft(kind, b, d, 50, k, gen)
    lp = with_zero_probability(lp, gen) if kind == "integer" else lp
    trees = build_trees(lp, tok, budget, backend="reference")
    for follow in (1.0, 0.7):
        post = path_posterior(trees, gen, follow)
        want = accept_paths(trees, post, backend="reference")
        dev_trees = build_trees(lp.to(kernel_device), tok.to(kernel_device), budget, backend="triton")
        got = accept_paths(dev_trees, post.to(kernel_device), backend="triton")
        for g, w in zip(got, want):
            assert torch.equal(g.cpu(), w)
        accepted, accept_len, bonus = want
        if follow == 1.0:  # always following a child: walks end at a leaf
            for r in range(b):
                last = int(accepted[r, accept_len[r] - 1])
                assert not (trees.parents[r, : int(trees.num_nodes[r])] == last).any()


def test_accepted_path_is_a_chain_of_matches():
    gen = torch.Generator().manual_seed(9)
    lp, tok = make_draft("bf16", 6, 5, 40, 8, gen)
    trees = build_trees(lp, tok, 25, backend="reference")
    post = path_posterior(trees, gen, 0.9)
    accepted, accept_len, bonus = accept_paths(trees, post, backend="reference")
    for r in range(6):
        path = accepted[r, : int(accept_len[r])].tolist()
        assert path[0] == 0 and (accepted[r, int(accept_len[r]) :] == -1).all()
        for parent, child in zip(path, path[1:]):
            assert int(trees.parents[r, child - 1]) == parent
            assert int(trees.tokens[r, child - 1]) == int(post[r, parent])
        assert int(bonus[r]) == int(post[r, path[-1]])


def test_bad_posterior():
    lp, tok = make_draft("normal", 2, 3, 10, 4, torch.Generator().manual_seed(0))
    trees = build_trees(lp, tok, 6, backend="reference")
    with pytest.raises(ValueError, match=r"budget \+ 1"):
        accept_paths(trees, torch.zeros(2, 6, dtype=torch.int64))
    with pytest.raises(TypeError, match="int32 or int64"):
        accept_paths(trees, torch.zeros(2, 7))
