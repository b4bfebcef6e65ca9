"""topk_logprobs: exact tie order, log-softmax values, both backends, bad input."""

import pytest
import torch

from ddtree.tree import topk_logprobs
from ddtree.tree.topk_triton import MAX_K, topk_logprobs_triton

from .helpers import make_logits


def _expected(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain specification: sort each row by (-logit, token id) in float64 and take k."""
    x = logits.double()
    b, d, v = x.shape
    tokens = torch.empty(b, d, k, dtype=torch.int64)
    for r in range(b):
        for j in range(d):
            row = x[r, j].tolist()
            tokens[r, j] = torch.tensor(sorted(range(v), key=lambda t: (-row[t], t))[:k])
    logprobs = x.gather(-1, tokens) - torch.logsumexp(x, -1, keepdim=True)
    return logprobs, tokens


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("kind", ["normal", "integer", "equal", "duplicated"])
def test_reference_backend_matches_specification(dtype, kind):
    gen = torch.Generator().manual_seed(0)
    logits = make_logits(kind, 2, 3, 37, gen).to(dtype)
    for k in (1, 5, 37):
        lp, tok = topk_logprobs(logits, k, backend="reference")
        want_lp, want_tok = _expected(logits, k)
        assert tok.dtype == torch.int64 and lp.dtype == torch.float32
        assert torch.equal(tok, want_tok), f"{kind} {dtype} k={k}"
        torch.testing.assert_close(lp.double(), want_lp, rtol=0, atol=2e-6)


@pytest.mark.parametrize("kind,dtype", [(kind, torch.bfloat16) for kind in ("bf16", "integer", "equal", "duplicated", "peaked")]
                         + [("bf16", torch.float32), ("duplicated", torch.float16)])
def test_triton_backend_matches_reference(kind, dtype, kernel_device):
    gen = torch.Generator().manual_seed(1)
    logits = make_logits(kind, 2, 2, 300, gen).to(dtype)
    for k in (1, 13, 64):
        want_lp, want_tok = topk_logprobs(logits, k, backend="reference")
        runs = [topk_logprobs(logits.to(kernel_device), k, backend="triton")]  # one chunk a row
        runs.append(topk_logprobs_triton(logits.to(kernel_device), k, chunk=64))  # 5 chunks, the last part padding
        for lp, tok in runs:
            assert torch.equal(tok.cpu(), want_tok), f"{kind} {dtype} k={k}"
            torch.testing.assert_close(lp.cpu(), want_lp, rtol=0, atol=4e-6)


@pytest.mark.cuda
@pytest.mark.parametrize("kind", ["bf16", "duplicated", "peaked"])
def test_triton_backend_at_a_drafters_shape(kind):
    """Moonlight's vocabulary (40 chunks a row) at k up to MAX_K, merged in groups."""
    gen = torch.Generator().manual_seed(3)
    logits = make_logits(kind, 2, 15, 163840, gen).bfloat16()
    for k in (16, 100, MAX_K):
        want_lp, want_tok = topk_logprobs(logits, k, backend="reference")
        lp, tok = topk_logprobs(logits.cuda(), k, backend="triton")
        assert torch.equal(tok.cpu(), want_tok), f"{kind} k={k}"
        torch.testing.assert_close(lp.cpu(), want_lp, rtol=0, atol=4e-6)


@pytest.mark.parametrize("k", [16, 64])
def test_the_chunks_bound_leaves_no_slack(k, kernel_device):
    """k a power of two and chunks of 4 k groups of one logit each: a chunk keeps exactly the
    logits at least its k-th largest, so a bound one rank too high loses a token (the pairwise
    count at 16, tl.topk of the group maxima at 64)."""
    logits = torch.randn(1, 3, 4 * k + 5, generator=torch.Generator().manual_seed(k))
    want_lp, want_tok = topk_logprobs(logits, k, backend="reference")
    lp, tok = topk_logprobs_triton(logits.to(kernel_device), k, chunk=4 * k)
    assert torch.equal(tok.cpu(), want_tok)
    torch.testing.assert_close(lp.cpu(), want_lp, rtol=0, atol=4e-6)


def test_triton_refuses_what_it_cannot_take():
    with pytest.raises(ValueError, match=f"k <= {MAX_K}"):
        topk_logprobs(torch.zeros(1, 1, MAX_K + 1), MAX_K + 1, backend="triton")
    with pytest.raises(ValueError, match="power-of-two chunk"):
        topk_logprobs_triton(torch.zeros(1, 1, 100), 20, chunk=16)


def test_negative_zero_ties_with_zero():
    logits = torch.tensor([[[0.0, -0.0, 1.0, -0.0, 0.0]]])
    _, tok = topk_logprobs(logits, 5, backend="reference")
    assert tok.tolist() == [[[2, 0, 1, 3, 4]]]


def test_log_probs_are_log_softmax():
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(3, 4, 50, generator=gen)
    lp, tok = topk_logprobs(logits, 50)
    want = torch.log_softmax(logits.double(), -1).gather(-1, tok)
    torch.testing.assert_close(lp.double(), want, rtol=0, atol=1e-6)
    assert (lp[..., 1:] <= lp[..., :-1]).all()


@pytest.mark.parametrize(
    "logits,k,error,match",
    [
        (torch.zeros(2, 5), 2, ValueError, r"\[B, D, V\]"),
        (torch.zeros(1, 2, 5, dtype=torch.int64), 2, TypeError, "float"),
        (torch.zeros(1, 2, 5), 0, ValueError, "k must be"),
        (torch.zeros(1, 2, 5), 6, ValueError, "k must be"),
    ],
)
def test_bad_input(logits, k, error, match):
    with pytest.raises(error, match=match):
        topk_logprobs(logits, k)


def test_bad_backend():
    with pytest.raises(ValueError, match="backend"):
        topk_logprobs(torch.zeros(1, 1, 4), 2, backend="cuda")
    with pytest.raises(ValueError, match="float64"):
        topk_logprobs(torch.zeros(1, 1, 4, dtype=torch.float64), 2, backend="triton")


def test_nan_logits_rank_first_as_in_the_reference(kernel_device):
    """A NaN logit (a broken drafter) sorts before every number in both backends, the other tokens
    in their order after it, and the row's log-probs are NaN."""
    logits = torch.randn(1, 2, 300, generator=torch.Generator().manual_seed(5))
    logits[0, 0, 17] = float("nan")
    logits[0, 1, 250] = float("nan")
    want_lp, want_tok = topk_logprobs(logits, 8, backend="reference")
    for lp, tok in (topk_logprobs(logits.to(kernel_device), 8, backend="triton"),
                    topk_logprobs_triton(logits.to(kernel_device), 8, chunk=64)):
        assert torch.equal(tok.cpu(), want_tok) and tok[0, 0, 0] == 17 and tok[0, 1, 0] == 250
        assert lp.isnan().all() and want_lp.isnan().all()


def test_a_plus_inf_logit_leaves_every_other_token_at_minus_inf(kernel_device):
    """As logsumexp: a row holding +inf has log-sum-exp +inf, so its +inf token's log-prob is NaN
    and every other's -inf, in both backends."""
    logits = torch.randn(1, 1, 500, generator=torch.Generator().manual_seed(6))
    logits[0, 0, 9] = float("inf")
    want_lp, want_tok = topk_logprobs(logits, 4, backend="reference")
    lp, tok = topk_logprobs(logits.to(kernel_device), 4, backend="triton")
    assert torch.equal(tok.cpu(), want_tok) and tok[0, 0, 0] == 9
    assert lp[0, 0, 0].isnan() and want_lp[0, 0, 0].isnan()
    assert torch.equal(lp.cpu()[0, 0, 1:], want_lp[0, 0, 1:]) and (want_lp[0, 0, 1:] == float("-inf")).all()


def test_minus_inf_logits_tie_in_token_order(kernel_device):
    # A row with few finite logits: the rest tie at -inf and must come in token order.
    logits = torch.full((1, 2, 600), float("-inf"))
    logits[0, 0, 5] = 1.0
    logits[0, 1, :3] = 0.0
    logits[0, 1, 590] = 0.0  # in the last of several chunks below
    want = [[[5, 0, 1, 2, 3, 4, 6, 7, 8, 9], [0, 1, 2, 590, 3, 4, 5, 6, 7, 8]]]
    runs = [topk_logprobs(logits, 10, backend="reference"),
            topk_logprobs(logits.to(kernel_device), 10, backend="triton"),
            topk_logprobs_triton(logits.to(kernel_device), 10, chunk=128)]  # 5 chunks
    for lp, tok in runs:
        assert tok.tolist() == want
        assert lp[0, 0, 0].item() == 0.0 and lp[0, 1, 0].item() == pytest.approx(-1.3862944, abs=1e-6)
