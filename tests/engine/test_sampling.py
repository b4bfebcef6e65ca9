"""The sampler: the vectorized choice equals the plain reference row by row, its distribution
matches softmax(logits / T) after top-k / top-p (chi-square), and its noise depends on
(seed, position, token) alone."""

import math

import pytest
import torch

from ddtree.engine.sampling import SamplingParams, choose_token_reference, choose_tokens, filter_mask, gumbel_noise


def _choose(logits, positions, params: list[SamplingParams]):
    t = torch.tensor([p.temperature for p in params], dtype=torch.float32)
    k = torch.tensor([p.top_k for p in params])
    top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32)
    seeds = torch.tensor([p.seed for p in params])
    return choose_tokens(logits, positions, t, k, top_p, seeds)


@pytest.mark.parametrize("vocab", [5, 96])
def test_vectorized_choice_equals_the_reference(vocab):
    gen = torch.Generator().manual_seed(vocab)
    params = [SamplingParams(0.0, seed=1), SamplingParams(1.0, seed=2), SamplingParams(0.7, top_k=3, seed=3),
              SamplingParams(1.3, top_p=0.6, seed=2**40 + 5), SamplingParams(0.5, top_p=0.9, top_k=4, seed=2**62)]
    logits = torch.randn(len(params), 12, vocab, generator=gen) * 3
    logits[0, 0, 1] = logits[0, 0, 2] = logits[0, 0].max() + 1  # an exact tie: the first index wins
    positions = torch.randint(0, 10_000, (len(params), 12), generator=gen)
    got = _choose(logits, positions, params)
    for b, p in enumerate(params):
        want = [choose_token_reference(logits[b, n].tolist(), int(positions[b, n]), p) for n in range(12)]
        assert got[b].tolist() == want, b
    assert int(got[0, 0]) == 1


def test_filter_mask_edges():
    logits = torch.tensor([[3.0, 1.0, 2.0, 2.0, -1.0]])
    one = lambda v, dtype=torch.float32: torch.tensor([v], dtype=dtype)  # noqa: E731
    keep = filter_mask(logits, one(1.0), one(2, torch.int64), one(1.0))
    assert keep.tolist() == [[True, False, True, False, False]]  # top-2, the tie cut by token id
    keep = filter_mask(logits, one(1.0), one(0, torch.int64), one(1e-6))
    assert keep.tolist() == [[True, False, False, False, False]]  # a tiny top_p keeps the best token
    keep = filter_mask(logits, one(1.0), one(0, torch.int64), one(1.0))
    assert keep.all()


def _chi_square_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """p-value of Pearson's statistic over the cells with probability > 0 (df = cells - 1)."""
    n = counts.sum()
    cells = probs > 0
    expected = probs[cells] * n
    stat = ((counts[cells] - expected) ** 2 / expected).sum()
    df = int(cells.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat.double() / 2))


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.6, 0, 1.0), (1.5, 4, 1.0), (1.0, 0, 0.8), (0.8, 5, 0.9)])
def test_sample_distribution_matches_the_filtered_softmax(temperature, top_k, top_p):
    """40,000 draws at distinct positions of one row of 8 logits. A false alarm (p < 1e-4 under a
    correct sampler) has probability 1e-4 per case; the seeds are fixed, so the outcome is too."""
    logits = torch.tensor([2.0, 1.5, 1.0, 0.9, 0.2, -0.5, -1.0, 0.0])
    draws = 40_000
    params = SamplingParams(temperature, top_p=top_p, top_k=top_k, seed=12345)
    positions = torch.arange(draws)[None]
    tokens = _choose(logits.expand(1, draws, 8), positions, [params])[0]
    counts = torch.bincount(tokens, minlength=8).double()
    # The expected distribution, computed independently in float64.
    probs = torch.softmax(logits.double() / temperature, -1)
    order = sorted(range(8), key=lambda v: -float(logits[v]))
    kept = order[: top_k or 8]
    mass = sum(float(probs[v]) for v in kept)
    final, before = [], 0.0
    for v in kept:
        if before < top_p * mass:
            final.append(v)
        before += float(probs[v])
    expected = torch.zeros(8, dtype=torch.float64)
    for v in final:
        expected[v] = probs[v]
    expected /= expected.sum()
    assert counts[expected == 0].sum() == 0, "a filtered-out token was sampled"
    assert _chi_square_p(counts, expected) > 1e-4, (counts / draws, expected)


def test_noise_is_a_function_of_seed_position_and_token():
    seeds = torch.tensor([[7], [7], [8]])
    positions = torch.tensor([[5, 6], [5, 6], [5, 6]])
    g = gumbel_noise(seeds, positions, 16)
    assert torch.equal(g[0], g[1])  # same seed and positions, another row of the batch
    assert not torch.equal(g[0, 0], g[0, 1]) and not torch.equal(g[0], g[2])
    assert torch.isfinite(g).all()
    # The uniforms behind it are spread: over many positions the mean Gumbel is Euler's constant.
    many = gumbel_noise(torch.tensor([3]), torch.arange(20_000), 4)
    assert abs(float(many.double().mean()) - 0.5772156649) < 0.02


def test_bad_sampling_parameters_are_named():
    for kwargs, field in [({"temperature": -1.0}, "temperature"), ({"temperature": math.nan}, "temperature"),
                          ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p"), ({"top_k": -2}, "top_k"),
                          ({"seed": -1}, "seed"), ({"max_new_tokens": 0}, "max_new_tokens"), ({"stop": ("",)}, "stop")]:
        with pytest.raises(ValueError, match=field):
            SamplingParams(**kwargs)
    assert SamplingParams(seed=None).with_seed().seed is not None
