"""build_trees refuses bad input with an error that names what was wrong."""

import math

import pytest
import torch

from ddtree.tree import build_trees, empty_trees

from .helpers import assert_trees_equal, make_draft


def _draft(b=2, d=3, k=4):
    return make_draft("normal", b, d, 10, k, torch.Generator().manual_seed(0))


@pytest.mark.parametrize(
    "mutate,error,match",
    [
        (lambda lp, tok: (lp[0], tok[0]), ValueError, r"\[B, D, K\]"),
        (lambda lp, tok: (lp.double(), tok), TypeError, "float32"),
        (lambda lp, tok: (lp, tok.int()), TypeError, "int64"),
        (lambda lp, tok: (lp, tok[:, :2]), ValueError, "shape"),
        (lambda lp, tok: (lp[:, :0], tok[:, :0]), ValueError, "D >= 1"),
    ],
)
def test_bad_shapes_and_dtypes(mutate, error, match):
    lp, tok = mutate(*_draft())
    for backend in ("reference", "auto"):
        with pytest.raises(error, match=match):
            build_trees(lp, tok, 4, backend=backend)


@pytest.mark.parametrize("budget", [0, -3, 2.5, True, None])
def test_bad_budget(budget):
    lp, tok = _draft()
    with pytest.raises(ValueError, match="budget"):
        build_trees(lp, tok, budget)


@pytest.mark.parametrize(
    "poison,match",
    [
        (lambda lp: lp.__setitem__((1, 2, 1), lp[1, 2, 0] + 0.5), "sorted descending.*batch 1, depth 2, rank 1"),
        (lambda lp: lp.__setitem__((0, 1, 2), math.nan), "NaN"),
        (lambda lp: lp.__setitem__((0, 0, 0), math.inf), r"\+inf"),
    ],
)
def test_bad_values_when_checked(poison, match, kernel_device):
    lp, tok = _draft()
    poison(lp)
    with pytest.raises(ValueError, match=match):
        build_trees(lp, tok, 4, backend="reference")
    with pytest.raises(ValueError, match=match):
        build_trees(lp.to(kernel_device), tok.to(kernel_device), 4, backend="triton", check=True)


def test_unused_ranks_are_not_checked():
    lp, tok = _draft(k=4)
    lp[..., 3] = 0.0  # out of order, but rank 3 is past min(K, budget) = 3
    build_trees(lp, tok, 3, backend="reference")


def test_negative_token_ids_refused():
    lp, tok = _draft()
    tok[0, 0, 0] = -5
    with pytest.raises(ValueError, match="negative token"):
        build_trees(lp, tok, 4, backend="reference")


def test_backend_limits(kernel_device):
    lp, tok = _draft()
    with pytest.raises(ValueError, match="backend must be one of"):
        build_trees(lp, tok, 4, backend="gpu")
    with pytest.raises(ValueError, match="budget <= 1024"):
        build_trees(lp.to(kernel_device), tok.to(kernel_device), 1025, backend="triton")
    assert int(build_trees(lp, tok, 1025, backend="reference").num_nodes.max()) == 4 + 16 + 64


def test_out_buffers(kernel_device):
    lp, tok = _draft()
    want = build_trees(lp, tok, 5, backend="reference")
    out = empty_trees(2, 5, 3, "cpu")
    assert build_trees(lp, tok, 5, backend="reference", out=out) is out
    assert_trees_equal(out, want)
    with pytest.raises(ValueError, match=r"out.visibility must be .* shape \(2, 6, 1\)"):
        bad = empty_trees(2, 5, 3, "cpu")
        bad.visibility = torch.empty(2, 5, 1, dtype=torch.int64)
        build_trees(lp, tok, 5, out=bad)
    with pytest.raises(ValueError, match="max_depth"):
        build_trees(lp, tok, 5, out=empty_trees(2, 5, 4, "cpu"))
