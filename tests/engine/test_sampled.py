"""Temperature > 0: with one seed, `ar`, `chain` and `ddtree` commit the same tokens, alone and in
a batch; a reported seed reproduces its output."""

import pytest
import torch

pytest.importorskip("transformers")

from ddtree import Engine  # noqa: E402
from oracle import OracleDrafter  # noqa: E402 (benchmarks/oracle.py)
from ddtree.models import load_drafter, load_target  # noqa: E402

from .pairs import make_pair, prompts  # noqa: E402


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    target_dir, drafter_dir, _ = make_pair(tmp_path_factory.mktemp("pair"), vocab=12, block_size=5)
    target = load_target(target_dir, dtype=torch.float32)
    return target, drafter_dir


SETTINGS = dict(temperature=[1.0, 0.7, 1.2, 0.9], top_p=[1.0, 0.9, 1.0, 0.8], top_k=[0, 0, 6, 4], seed=[11, 12, 13, 2**50])


def test_same_seed_same_tokens_in_every_mode(models):
    target, drafter_dir = models
    engine = Engine(target, load_drafter(drafter_dir, target), page_size=8, max_batch=4)
    batch = prompts(4, 12, seed=1)
    ar = [o.token_ids for o in engine.generate(batch, max_new_tokens=32, mode="ar", **SETTINGS)]
    assert len({tuple(t) for t in ar}) == 4
    for mode, budget in [("chain", 1), ("ddtree", 4), ("ddtree", 24)]:
        outs = engine.generate(batch, max_new_tokens=32, mode=mode, budget=budget, **SETTINGS)
        assert [o.token_ids for o in outs] == ar, mode
    other = engine.generate(batch, max_new_tokens=32, mode="ar", **{**SETTINGS, "seed": [1, 2, 3, 4]})
    assert [o.token_ids for o in other] != ar  # the seed matters


def test_a_request_does_not_depend_on_its_batch(models):
    target, drafter_dir = models
    engine = Engine(target, load_drafter(drafter_dir, target), page_size=8, max_batch=4)
    batch = prompts(4, 12, seed=2)
    together = engine.generate(batch, max_new_tokens=24, mode="ddtree", budget=16, **SETTINGS)
    for i, p in enumerate(batch):
        alone = engine.generate([p], max_new_tokens=24, mode="ddtree", budget=16,
                                **{k: [v[i]] for k, v in SETTINGS.items()})
        assert alone[0].token_ids == together[i].token_ids


def test_deep_sampled_commits_stay_exact(models):
    """The oracle proposes ar's sampled continuation: rounds commit whole blocks at temperature
    1, and the tokens are ar's."""
    target, drafter_dir = models
    batch = prompts(2, 12, seed=4)
    settings = dict(temperature=1.0, top_k=0, top_p=1.0, seed=[5, 6])
    ar = Engine(target, load_drafter(drafter_dir, target), page_size=8, max_batch=2).generate(
        batch, max_new_tokens=30, mode="ar", **settings)
    oracle = OracleDrafter(load_drafter(drafter_dir, target), max_batch=2, max_len=64)
    for slot, (p, o) in enumerate(zip(batch, ar)):
        oracle.set_sequence(slot, p + o.token_ids)
    outs = Engine(target, oracle, page_size=8, max_batch=2).generate(batch, max_new_tokens=30, mode="ddtree",
                                                                     budget=8, **settings)
    assert [o.token_ids for o in outs] == [o.token_ids for o in ar]
    assert max(outs[0].stats.acceptance_lengths) == 5


def test_unseeded_requests_report_a_seed_that_reproduces_them(models):
    target, drafter_dir = models
    engine = Engine(target, load_drafter(drafter_dir, target), page_size=8)
    first = engine.generate([[3, 4, 5]], max_new_tokens=16, temperature=1.0, seed=None)[0]
    again = engine.generate([[3, 4, 5]], max_new_tokens=16, temperature=1.0, seed=first.seed, mode="ar")[0]
    assert again.token_ids == first.token_ids
