"""The paged prefill (non-absorbed, causal SDPA over the expanded latents) against the plain causal
prefill and against the absorbed verify path, float32: logits, hidden features and every cache
entry, over chunks with mixed prefixes and row counts, on shuffled pages poisoned with NaN."""

import pytest
import torch
from torch.nn.attention.bias import CausalBias

pytest.importorskip("transformers")

from ddtree.models import ForwardMeta, PrefillMeta  # noqa: E402
from ddtree.tree import pack_visibility  # noqa: E402

from .checkpoints import shuffled_block_table, tiny_config, tiny_float32_target  # noqa: E402

PAGE = 4
LAYERS = (0, 2)  # hidden features returned, as the drafter's target layers would be


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return tiny_float32_target(tmp_path_factory)


def _poisoned_cache(target, block_table):
    """Caches whose every slot is NaN; the scratch page is the one past the table's pages + 3 spare."""
    caches = target.new_cache(block_table.numel() + 3, PAGE)
    for cache in caches:
        cache.fill_(float("nan"))
    return caches, block_table.numel() + 3


def _absorbed_meta(block_table, prefix_lens, num_rows, rows, scratch_page):
    b = len(prefix_lens)
    prefix = torch.tensor(prefix_lens, dtype=torch.int32)
    return ForwardMeta.build(
        block_table, prefix, torch.tensor(num_rows, dtype=torch.int32), prefix.long()[:, None] + torch.arange(rows),
        pack_visibility(torch.ones(rows, rows, dtype=torch.bool).tril().expand(b, rows, rows)),
        page_size=PAGE, scratch_page=scratch_page,
    )


@torch.no_grad()
def test_one_request_from_position_0_equals_the_plain_prefill(target):
    ids = torch.randint(0, 96, (1, 11), generator=torch.Generator().manual_seed(0))
    want, want_hidden = target(ids, hidden_layers=LAYERS)
    bt = shuffled_block_table(1, 3, seed=1)
    caches, scratch = _poisoned_cache(target, bt)
    meta = PrefillMeta.build(bt, [0], [11], 11, page_size=PAGE, scratch_page=scratch)
    assert meta.attn_mask is None and meta.key_written is None  # SDPA's is_causal path
    got, hidden = target.forward_paged(ids, meta, caches, LAYERS)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for h, w in zip(hidden, want_hidden):
        torch.testing.assert_close(h, w, rtol=1e-5, atol=1e-6)


@torch.no_grad()
def test_one_request_in_chunks_equals_the_plain_prefill(target):
    """Chunks after the first attend to the prefix in the pages (a lower-right causal mask)."""
    ids = torch.randint(0, 96, (1, 14), generator=torch.Generator().manual_seed(2))
    want, _ = target(ids)
    bt = shuffled_block_table(1, 4, seed=3)
    caches, scratch = _poisoned_cache(target, bt)
    for start, stop in ((0, 5), (5, 6), (6, 14)):
        meta = PrefillMeta.build(bt, [start], [stop - start], stop - start, page_size=PAGE, scratch_page=scratch)
        assert (meta.attn_mask is None) == (start == 0)
        got, _ = target.forward_paged(ids[:, start:stop], meta, caches)
        torch.testing.assert_close(got, want[:, start:stop], rtol=1e-5, atol=1e-5)


# (prefix per request, valid rows per request, rows N) of each call; the mask each one takes
SCHEDULE = [
    ([0, 0, 0], [5, 5, 5], 5),  # every prefix 0: is_causal
    ([5, 5, 5], [3, 1, 3], 3),  # one prefix, padding rows: lower-right causal, unwritten keys zeroed
    ([8, 6, 8], [4, 4, 2], 4),  # different prefixes and padding: dense mask, a page boundary inside
    ([12, 10, 10], [3, 3, 3], 3),  # different prefixes, no padding: keys past request 1's 13 unwritten
]
MASKS = [type(None), CausalBias, torch.Tensor, torch.Tensor]


@torch.no_grad()
def test_chunks_with_mixed_prefixes_equal_the_absorbed_path(target):
    gen = torch.Generator().manual_seed(4)
    final = [p + n for p, n in zip(*SCHEDULE[-1][:2])]  # 15, 13, 13 tokens
    prompts = torch.randint(0, 96, (3, 4 * PAGE), generator=gen)  # room for every padded chunk
    bt = shuffled_block_table(3, 4, seed=5)
    runs = {}
    for form in ("expanded", "absorbed"):
        caches, scratch = _poisoned_cache(target, bt)
        outputs = []
        for (prefix, counts, rows), mask in zip(SCHEDULE, MASKS):
            for cache in caches:  # what the scratch page holds is garbage by contract
                cache[scratch] = float("nan")
            ids = torch.stack([prompts[b, p : p + rows] for b, p in enumerate(prefix)])
            ids = ids.masked_fill(torch.arange(rows) >= torch.tensor(counts)[:, None], 0)  # padding: any token
            if form == "expanded":
                meta = PrefillMeta.build(bt, prefix, counts, rows, page_size=PAGE, scratch_page=scratch)
                assert isinstance(meta.attn_mask, mask), (prefix, counts)
            else:
                meta = _absorbed_meta(bt, prefix, counts, rows, scratch)
            logits, hidden = target.forward_paged(ids, meta, caches, LAYERS)
            if form == "expanded":  # padding rows too: no row is fully masked, no unwritten key is read
                assert torch.isfinite(logits).all(), (prefix, counts)
            outputs.append((counts, logits, torch.cat(hidden, -1)))
        runs[form] = caches, outputs
    (got_caches, got), (want_caches, want) = runs["expanded"], runs["absorbed"]
    for (counts, logits, hidden), (_, want_logits, want_hidden) in zip(got, want):
        for b, n in enumerate(counts):  # valid rows only: padding rows are garbage in both forms
            torch.testing.assert_close(logits[b, :n], want_logits[b, :n], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(hidden[b, :n], want_hidden[b, :n], rtol=1e-5, atol=1e-5)
    prompt_slot = torch.zeros(bt.numel() + 3, PAGE, dtype=torch.bool)  # request pages: slot of a prompt token
    for b, n in enumerate(final):
        for t in range(n):
            prompt_slot[bt[b, t // PAGE], t % PAGE] = True
    for cache, want_cache in zip(got_caches, want_caches):
        requests = cache[:-1]  # the scratch page (last) took the padding rows, in both forms
        assert torch.equal(requests.isnan().all(-1), ~prompt_slot), "a prompt slot unwritten or a stray write"
        torch.testing.assert_close(requests[prompt_slot], want_cache[:-1][prompt_slot], rtol=1e-5, atol=1e-5)


def test_build_refuses_inconsistent_lengths():
    bt = shuffled_block_table(2, 2, seed=6)
    with pytest.raises(ValueError, match="one entry per request"):
        PrefillMeta.build(bt, [0, 0], [1], 2, page_size=PAGE, scratch_page=7)
    with pytest.raises(ValueError, match="num_rows"):
        PrefillMeta.build(bt, [0, 0], [3, 1], 2, page_size=PAGE, scratch_page=7)


@pytest.mark.cuda
@torch.no_grad()
def test_chunked_prefill_on_cuda_matches_the_plain_prefill_bf16():
    """At Kimi K2's latent shape in bf16 on CUDA, SDPA's own kernels take is_causal, the lower-right
    bias and the dense mask; the chunked paged prefill agrees with the plain prefill to bf16 accuracy."""
    import json

    from ddtree.models import TargetConfig, random_target

    raw = json.loads(tiny_config(kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=64).to_json_string())
    model = random_target(TargetConfig.from_dict(raw), dtype=torch.bfloat16, device="cuda", std=0.05)
    ids = torch.randint(0, 96, (2, 40), device="cuda", generator=torch.Generator(device="cuda").manual_seed(0))
    want, _ = model(ids)
    bt = shuffled_block_table(2, 12, seed=7).cuda()
    caches = model.new_cache(bt.numel() + 3, PAGE)
    schedule = [([0, 0], [16, 16], 16), ([16, 16], [14, 9], 14), ([30, 25], [10, 15], 15)]
    for (prefix, counts, rows), mask in zip(schedule, [type(None), CausalBias, torch.Tensor]):
        chunk = torch.zeros(2, rows, dtype=torch.long, device="cuda")
        for b, (p, n) in enumerate(zip(prefix, counts)):
            chunk[b, :n] = ids[b, p : p + n]
        meta = PrefillMeta.build(bt, prefix, counts, rows, page_size=PAGE, scratch_page=bt.numel() + 3)
        assert isinstance(meta.attn_mask, mask)
        got, _ = model.forward_paged(chunk, meta, caches)
        for b, (p, n) in enumerate(zip(prefix, counts)):
            err = (got[b, :n] - want[b, p : p + n]).norm() / want[b, p : p + n].norm()
            assert err < 2e-2, f"request {b}, rows {p}..{p + n - 1}: relative error {err:.2e}"
