"""Temperature 0: `ddtree` and `chain` equal `ar`, and `ar` equals transformers' greedy generate of
the same checkpoint, token for token, over batches that mix prompt lengths."""

import pytest
import torch

pytest.importorskip("transformers")

from ddtree import Engine  # noqa: E402
from oracle import OracleDrafter  # noqa: E402 (benchmarks/oracle.py)
from ddtree.models import load_drafter, load_target  # noqa: E402

from .pairs import make_pair, prompts  # noqa: E402

NEW = 24


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return make_pair(tmp_path_factory.mktemp("pair"))


@pytest.fixture(scope="module")
def ar_outputs(pair):
    """The ar baseline of 6 prompts, checked once against transformers' greedy generate."""
    target_dir, drafter_dir, hf = pair
    batch = prompts(6, 96, seed=0)
    engine = Engine.from_pretrained(target_dir, drafter_dir, device="cpu", page_size=16, max_batch=8, stop_token_ids=())
    outs = [o.token_ids for o in engine.generate(batch, max_new_tokens=NEW, mode="ar")]
    with torch.no_grad():
        for p, got in zip(batch, outs):
            want = hf.generate(torch.tensor([p]), max_new_tokens=NEW, do_sample=False, eos_token_id=None, pad_token_id=0)
            assert got == want[0, len(p):].tolist()
    return batch, outs


@pytest.mark.parametrize("mode,budget", [("chain", 0), ("ddtree", 1), ("ddtree", 4), ("ddtree", 16), ("ddtree", 64)])
def test_tree_modes_equal_ar(pair, ar_outputs, mode, budget):
    target_dir, drafter_dir, _ = pair
    batch, want = ar_outputs
    engine = Engine.from_pretrained(target_dir, drafter_dir, device="cpu", page_size=16, max_batch=8, stop_token_ids=())
    outs = engine.generate(batch, max_new_tokens=NEW, mode=mode, budget=budget or 1)
    assert [o.token_ids for o in outs] == want
    for o in outs:
        assert 1 + sum(o.stats.acceptance_lengths) == len(o.token_ids) == NEW
        assert o.stats.rounds == len(o.stats.acceptance_lengths)


def test_mixed_modes_and_budgets_in_one_batch(pair, ar_outputs):
    """Per-request modes and budgets in one batch: each request still equals its ar output."""
    target_dir, drafter_dir, _ = pair
    batch, want = ar_outputs
    engine = Engine.from_pretrained(target_dir, drafter_dir, device="cpu", page_size=16, max_batch=4, stop_token_ids=())
    modes = ["ar", "chain", "ddtree", "ddtree", "ar", "ddtree"]
    budgets = [1, 1, 3, 32, 1, 9]
    outs = engine.generate(batch, max_new_tokens=NEW, mode=modes, budget=budgets)  # 6 prompts, 4 slots
    assert [o.token_ids for o in outs] == want
    assert all(a == 1 for a in outs[0].stats.acceptance_lengths)


def test_small_vocabulary_accepts_several_tokens_a_round(tmp_path):
    """Vocabulary 8 <= budget 16: the whole first level fits in the tree, so most rounds commit
    more than one token, and ddtree still equals ar."""
    target_dir, drafter_dir, hf = make_pair(tmp_path, vocab=8, block_size=6)
    batch = prompts(4, 8, seed=3)
    engine = Engine.from_pretrained(target_dir, drafter_dir, device="cpu", page_size=16, stop_token_ids=())
    ar = [o.token_ids for o in engine.generate(batch, max_new_tokens=30, mode="ar")]
    with torch.no_grad():
        want = hf.generate(torch.tensor([batch[0]]), max_new_tokens=30, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert ar[0] == want[0, len(batch[0]):].tolist()
    for budget in (16, 64):
        outs = engine.generate(batch, max_new_tokens=30, mode="ddtree", budget=budget)
        assert [o.token_ids for o in outs] == ar
        lengths = [a for o in outs for a in o.stats.acceptance_lengths]
        assert sum(lengths) / len(lengths) > 1.5, lengths


@pytest.mark.parametrize("block_size", [4, 9])
def test_a_drafter_that_knows_the_answer_commits_whole_blocks(tmp_path, block_size):
    """With the true continuation proposed, rounds commit at every depth up to the block size,
    and the committed tokens are still exactly ar's."""
    target_dir, drafter_dir, _ = make_pair(tmp_path, block_size=block_size)
    target = load_target(target_dir, dtype=torch.float32)
    batch = prompts(3, 96, seed=5)
    plain = Engine(target, load_drafter(drafter_dir, target), page_size=16, max_batch=4)
    ar = [o.token_ids for o in plain.generate(batch, max_new_tokens=40, mode="ar")]
    for depth in range(1, block_size):  # the oracle knows `depth` tokens ahead
        oracle = OracleDrafter(load_drafter(drafter_dir, target), max_batch=4, max_len=128, depth=depth)
        for slot, (p, out) in enumerate(zip(batch, ar)):  # generate fills slots 0, 1, 2 in order
            oracle.set_sequence(slot, p + out)
        engine = Engine(target, oracle, page_size=16, max_batch=4)
        for mode in ("chain", "ddtree"):
            outs = engine.generate(batch, max_new_tokens=40, mode=mode, budget=2 * block_size)
            assert [o.token_ids for o in outs] == ar, (mode, depth)
            for o in outs:  # every round but a last one cut by max_new_tokens takes the known tokens
                lengths = o.stats.acceptance_lengths
                assert all(a >= depth + 1 for a in lengths[:-1]) and max(lengths) <= block_size, (mode, depth, lengths)
            if depth == block_size - 1:
                assert max(outs[0].stats.acceptance_lengths) == block_size  # a whole block in one round


def test_chunked_prefill_equals_one_pass(pair, ar_outputs):
    """Prompts of 3-17 tokens through chunks of 5 (several chunks, ragged last ones, prompts that
    end at a chunk boundary) give the same tokens as a one-chunk prefill."""
    target_dir, drafter_dir, _ = pair
    batch, want = ar_outputs
    batch = batch + [[7] * 10]  # exactly two chunks
    engine = Engine.from_pretrained(target_dir, drafter_dir, device="cpu", page_size=16, max_batch=8, stop_token_ids=(),
                                    prefill_chunk=5)
    one_pass = Engine.from_pretrained(target_dir, drafter_dir, device="cpu", page_size=16, stop_token_ids=())
    extra = one_pass.generate([batch[-1]], max_new_tokens=NEW, mode="ddtree", budget=8)[0].token_ids
    for mode in ("ar", "ddtree"):
        outs = engine.generate(batch, max_new_tokens=NEW, mode=mode, budget=8)
        assert [o.token_ids for o in outs] == want + [extra], mode




def test_the_engine_commits_through_the_one_launch_move(pair, ar_outputs, kernel_device, monkeypatch):
    """The round's cache moves through ops/cache_moves.py's kernel (interpreted here), over the
    engine's own caches (views of one tensor): ddtree still equals ar."""
    if kernel_device != "cpu":
        pytest.skip("the engine here runs on the CPU: its kernels only interpreted")
    from ddtree.engine import commit
    from ddtree.engine import round as round_module
    from ddtree.ops import KERNELS, cache_moves

    calls = []

    def through_the_kernel(caches, *args):
        assert cache_moves.layer_stride(caches) is not None  # Target.new_cache's views
        calls.append(args[2].shape[0])
        commit.commit(caches, *args[:-1], KERNELS)

    monkeypatch.setattr(round_module, "commit", through_the_kernel)
    monkeypatch.setattr(cache_moves, "move_entries_reference", lambda *a: pytest.fail("the PyTorch moves ran"))
    target_dir, drafter_dir, _ = pair
    batch, want = ar_outputs
    engine = Engine.from_pretrained(target_dir, drafter_dir, device="cpu", page_size=16, max_batch=8, stop_token_ids=())
    outs = engine.generate(batch, max_new_tokens=NEW, mode="ddtree", budget=16)
    assert calls and [o.token_ids for o in outs] == want
