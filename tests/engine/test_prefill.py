"""engine.prefill over several chunks writes the cache entries, feeds the drafter the context and
chooses the first tokens of the same prefill in one chunk, for a batch of mixed prompt lengths on
shuffled pages poisoned with NaN; and those are the plain causal forward's (the model-level
prefill form is checked against the verify form in tests/models/test_paged_prefill.py). Prompts
prefilled in groups padded to a row bucket (what the prefill graphs replay), alone or together, do
the same and touch no other slot."""

import pytest
import torch

pytest.importorskip("transformers")

from ddtree.engine.batch import BatchState, SlotSettings  # noqa: E402
from ddtree.engine.prefill import prefill  # noqa: E402
from ddtree.engine.prefill_graphs import PrefillGraphs, groups_of, row_buckets  # noqa: E402
from ddtree.engine.round import RoundContext  # noqa: E402
from ddtree.models import load_drafter, load_target  # noqa: E402

from .pairs import make_pair  # noqa: E402

PAGE, PAGES_EACH, CHUNK = 4, 4, 4
LENGTHS = [13, 6, 11, 4]  # chunks of 4: all full, then padded, then one prompt's last row
SLOTS = [3, 0, 4, 1]  # any slots, in any order


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    target_dir, drafter_dir, _ = make_pair(tmp_path_factory.mktemp("pair"))
    target = load_target(target_dir, dtype=torch.float32)
    return target, load_drafter(drafter_dir, target)


def _run(target, drafter, prompts, chunk, fill=None):
    """fill(ctx, state, caches): another way to prefill SLOTS with prompts (default engine.prefill)."""
    pages = len(SLOTS) * PAGES_EACH + 2  # 2 spare pages; the scratch page comes after them
    caches = target.new_cache(pages, PAGE)
    for cache in caches:
        cache.fill_(float("nan"))
    state = BatchState(5, PAGES_EACH, torch.device("cpu"), drafter, drafter_capacity=20)
    order = torch.randperm(pages, generator=torch.Generator().manual_seed(1))[: len(SLOTS) * PAGES_EACH]
    for slot, table in zip(SLOTS, order.view(len(SLOTS), PAGES_EACH)):
        state.occupy(slot, SlotSettings(0, False, 0.0, 0, 1.0, 0))
        state.block_table[slot] = table.int()
    ctx = RoundContext(target, drafter, caches, PAGE, pages, drafter.cfg.target_layer_ids, target.cfg.n_routed_experts)
    with torch.no_grad():
        if fill is None:
            first = prefill(ctx, state, SLOTS, prompts, chunk, any_sampled=False, any_filtered=False)
        else:
            first = fill(ctx, state, caches)
    return first, caches, state


def test_chunks_equal_one_prefill_and_the_plain_forward(models):
    target, drafter = models
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, 96, (n,), generator=gen).tolist() for n in LENGTHS]
    first, caches, state = _run(target, drafter, prompts, CHUNK)
    want_first, want_caches, want_state = _run(target, drafter, prompts, max(LENGTHS))
    assert torch.equal(first, want_first)
    assert torch.equal(state.bonus, want_state.bonus) and torch.equal(state.prefix_lens, want_state.prefix_lens)
    assert state.prefix_lens[SLOTS].tolist() == LENGTHS
    prompt_slot = torch.zeros(caches[0].shape[:2], dtype=torch.bool)
    for slot, n in zip(SLOTS, LENGTHS):
        for t in range(n):
            prompt_slot[state.block_table[slot, t // PAGE], t % PAGE] = True
    for cache, want in zip(caches, want_caches):
        # every prompt position written, nothing else outside the scratch page (the last)
        assert torch.equal(cache[:-1].isnan().all(-1), ~prompt_slot[:-1])
        torch.testing.assert_close(cache[prompt_slot], want[prompt_slot], rtol=1e-5, atol=1e-5)
    ctx, want_ctx = state.drafter, want_state.drafter
    assert torch.equal(ctx.lengths, want_ctx.lengths) and ctx.lengths[SLOTS].tolist() == LENGTHS
    for got_layer, want_layer in zip(ctx.keys + ctx.values, want_ctx.keys + want_ctx.values):
        for slot, n in zip(SLOTS, LENGTHS):  # past a prompt's length: padding rows' garbage
            torch.testing.assert_close(got_layer[slot, :n], want_layer[slot, :n], rtol=1e-5, atol=1e-5)
    # the plain causal forward of each prompt alone: its greedy next token and its drafter context
    for i, (slot, prompt) in enumerate(zip(SLOTS, prompts)):
        with torch.no_grad():
            logits, hidden = target(torch.tensor([prompt]), hidden_layers=drafter.cfg.target_layer_ids)
            alone = drafter.new_cache(1, 20)
            drafter.append_context(alone, torch.cat(hidden, -1), torch.tensor([len(prompt)]))
        assert int(first[i]) == int(logits[0, -1].argmax())
        for got_layer, want_layer in zip(ctx.keys + ctx.values, alone.keys + alone.values):
            torch.testing.assert_close(got_layer[slot, : len(prompt)], want_layer[0, : len(prompt)], rtol=1e-4, atol=1e-5)


def test_row_buckets_hold_the_longest_prompt_and_groups_the_admission():
    assert row_buckets(1) == [16] and row_buckets(16) == [16]
    assert row_buckets(17) == [16, 32] and row_buckets(512) == [16, 32, 64, 128, 256, 512]
    assert [groups_of(n) for n in (1, 2, 3, 4, 7, 11)] == [[1], [2], [2, 1], [4], [4, 2, 1], [4, 4, 2, 1]]


@pytest.mark.parametrize("together", [False, True])
def test_prompts_in_padded_groups_equal_one_prefill(models, together):
    """PrefillGraphs without a pool (a CUDA engine without graphs; with them the same work is
    replayed): the prompts one by one, or all four as one group sorted by length, each padded to
    16 rows, give the batch prefill's first tokens (in the order given), cache entries and drafter
    context, and leave every other slot's entries as they were (padding rows write only the
    scratch page)."""
    target, drafter = models
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(1, 96, (n,), generator=gen).tolist() for n in LENGTHS]
    want_first, want_caches, want_state = _run(target, drafter, prompts, max(LENGTHS))

    def in_groups(ctx, state, caches):
        graphs = PrefillGraphs(ctx, state, None, largest=max(LENGTHS))
        assert graphs.buckets == [16] and graphs.covers(prompts)
        if together:
            first = graphs.prefill(SLOTS, prompts, False, False)
            assert graphs.eager_prefills == 1 and graphs.replays == 0
            return first
        firsts = []
        for slot, prompt in zip(SLOTS, prompts):
            before = [cache.clone() for cache in caches]
            firsts.append(graphs.prefill([slot], [prompt], False, False))
            mine = torch.zeros(caches[0].shape[:2], dtype=torch.bool)
            for t in range(len(prompt)):
                mine[state.block_table[slot, t // PAGE], t % PAGE] = True
            mine[-1] = True  # the scratch page
            for cache, old in zip(caches, before):
                torch.testing.assert_close(cache[~mine], old[~mine], rtol=0, atol=0, equal_nan=True)
        assert graphs.eager_prefills == len(prompts) and graphs.replays == 0
        return torch.cat(firsts)

    first, caches, state = _run(target, drafter, prompts, CHUNK, fill=in_groups)
    assert torch.equal(first, want_first)
    assert torch.equal(state.bonus, want_state.bonus) and torch.equal(state.prefix_lens, want_state.prefix_lens)
    for cache, want in zip(caches, want_caches):
        written = ~want[:-1].isnan().all(-1)
        assert torch.equal(~cache[:-1].isnan().all(-1), written)
        torch.testing.assert_close(cache[:-1][written], want[:-1][written], rtol=1e-5, atol=1e-5)
    ctx, want_ctx = state.drafter, want_state.drafter
    assert torch.equal(ctx.lengths, want_ctx.lengths)
    for got_layer, want_layer in zip(ctx.keys + ctx.values, want_ctx.keys + want_ctx.values):
        for slot, n in zip(SLOTS, LENGTHS):
            torch.testing.assert_close(got_layer[slot, :n], want_layer[slot, :n], rtol=1e-5, atol=1e-5)


def test_a_prompt_past_the_largest_bucket_is_left_to_the_chunked_prefill(models):
    target, drafter = models
    state = BatchState(5, PAGES_EACH, torch.device("cpu"), drafter, drafter_capacity=20)
    ctx = RoundContext(target, drafter, target.new_cache(4, PAGE), PAGE, 4, drafter.cfg.target_layer_ids,
                       target.cfg.n_routed_experts)
    graphs = PrefillGraphs(ctx, state, None, largest=12)
    assert graphs.covers([[1] * 12] * 5)
    assert not graphs.covers([[1] * 13]) and not graphs.covers([[1]] * 3 + [[1] * 13])
