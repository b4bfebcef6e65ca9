"""Absorbed verify / decode over the paged cache against the plain causal prefill (float32):
a paged prefill, step-by-step decode, and a tree verify whose logits equal per-branch decoding."""

import pytest
import torch

pytest.importorskip("transformers")

from ddtree.models.paged import ForwardMeta  # noqa: E402
from ddtree.tree import build_trees, pack_visibility, topk_logprobs  # noqa: E402

from ..conftest import CUDA_AND_INTERPRETED  # noqa: E402
from .checkpoints import shuffled_block_table, tiny_config, tiny_float32_target  # noqa: E402

PAGE = 4


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return tiny_float32_target(tmp_path_factory)


def _chain_meta(block_table, prefix_lens, n, num_rows=None, scratch_page=None):
    """A causal chain of n new rows; the scratch page defaults to new_cache's (3 spare pages past the table)."""
    b = block_table.shape[0]
    prefix = torch.tensor(prefix_lens, dtype=torch.int32)
    return ForwardMeta.build(
        block_table, prefix, torch.tensor(num_rows or [n] * b, dtype=torch.int32),
        prefix.long()[:, None] + torch.arange(n),
        pack_visibility(torch.ones(n, n, dtype=torch.bool).tril().expand(b, n, n)),
        page_size=PAGE, scratch_page=block_table.numel() + 3 if scratch_page is None else scratch_page,
    )


@torch.no_grad()
def test_paged_prefill_then_decode_matches_prefill(target):
    ids = torch.randint(0, 96, (2, 13), generator=torch.Generator().manual_seed(0))
    want, want_hidden = target(ids, hidden_layers=(1,))
    bt = shuffled_block_table(2, 4, seed=1)
    caches = target.new_cache(bt.numel() + 3, PAGE)
    got, hidden = target.forward_paged(ids[:, :9], _chain_meta(bt, [0, 0], 9), caches, hidden_layers=(1,))
    torch.testing.assert_close(got, want[:, :9], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(hidden[0], want_hidden[0][:, :9], rtol=1e-4, atol=1e-4)
    for t in range(9, 13):  # one token at a time, crossing page boundaries
        step, _ = target.forward_paged(ids[:, t : t + 1], _chain_meta(bt, [t, t], 1), caches)
        torch.testing.assert_close(step[:, 0], want[:, t], rtol=1e-4, atol=1e-4)


@torch.no_grad()
def test_tree_verify_equals_per_branch_decoding(target):
    gen = torch.Generator().manual_seed(3)
    prompt = torch.randint(0, 96, (2, 6), generator=gen)
    lp, tok = topk_logprobs(torch.randn(2, 3, 96, generator=gen) * 2, 3)
    trees = build_trees(lp, tok, 7, backend="reference")
    trees.num_nodes[1] = 4  # request 1 verifies a smaller tree: its rows 5.. are padding
    n = 8  # root + 7 nodes
    bt = shuffled_block_table(2, 4, seed=4)
    caches = target.new_cache(bt.numel() + 3, PAGE)
    target.forward_paged(prompt[:, :5], _chain_meta(bt, [0, 0], 5), caches)  # commit 5 tokens
    root = prompt[:, 5:6]
    rows = torch.cat([root, trees.tokens.clamp_min(0)], dim=1)  # [B, 8]
    depths = torch.cat([torch.zeros(2, 1, dtype=torch.long), trees.depths.clamp_min(0)], dim=1)
    meta = ForwardMeta.build(
        bt, torch.tensor([5, 5], dtype=torch.int32), (trees.num_nodes + 1).int(), 5 + depths, trees.visibility[:, :n],
        page_size=PAGE, scratch_page=bt.numel() + 3,
    )
    got, _ = target.forward_paged(rows, meta, caches)
    for r in range(2):
        for i in range(int(trees.num_nodes[r]) + 1):
            path, node = [], i  # root .. node i, by parents
            while node:
                path.append(int(trees.tokens[r, node - 1]))
                node = int(trees.parents[r, node - 1])
            seq = torch.cat([prompt[r, :6], torch.tensor(path[::-1], dtype=torch.long)])[None]
            want = target(seq)[0][0, -1]
            torch.testing.assert_close(got[r, i], want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("device", CUDA_AND_INTERPRETED)
@torch.no_grad()
def test_verify_with_the_triton_kernel_matches_prefill_bf16(device, monkeypatch):
    """At Kimi K2's latent shape (kv_lora_rank 512, rope 64) the paged forward runs the tree-verify
    kernel (on CUDA by the default policy; on the CPU, interpreted, where the attention layers'
    policy takes the kernels: fewer tokens and layers); it must agree with the plain prefill to
    bf16 accuracy."""
    import json

    from ddtree.models import TargetConfig, random_target
    from ddtree.models import paged
    from ddtree.models.target import MLA
    from ddtree.ops import KernelPolicy

    tokens, layers = (40, 3) if device == "cuda" else (12, 1)
    calls = []
    real = paged.tree_verify_mla
    monkeypatch.setattr(paged, "tree_verify_mla", lambda *a, **kw: calls.append(a[0].shape) or real(*a, **kw))
    raw = json.loads(tiny_config(kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=64,
                                 num_hidden_layers=layers).to_json_string())
    model = random_target(TargetConfig.from_dict(raw), dtype=torch.bfloat16, device=device, std=0.05)
    if device == "cpu":  # the kernel path of attention only: the rest of the model stays PyTorch
        for layer in model.modules():
            if isinstance(layer, MLA):
                layer.policy = KernelPolicy(auto_devices=("cuda", "cpu"))
    ids = torch.randint(0, 96, (2, tokens), generator=torch.Generator().manual_seed(0)).to(device)
    want, _ = model(ids)
    bt = shuffled_block_table(2, 12, seed=5).to(device)
    caches = model.new_cache(bt.numel() + 3, PAGE)
    meta = _chain_meta(bt.cpu(), [0, 0], tokens)
    meta = ForwardMeta(**{k: v.to(device) for k, v in vars(meta).items()})
    got, _ = model.forward_paged(ids, meta, caches)
    assert calls == [(2, tokens, 4, 576)] * layers, "each layer's attention must run the kernel"
    err = (got - want).norm() / want.norm()
    assert err < 2e-2, f"relative error {err:.2e}"


@pytest.mark.cuda
@torch.no_grad()
def test_tree_verify_forward_captures_in_a_cuda_graph():
    """The verify / decode forward (kernel attention, grouped-GEMM MoE) has no host sync and no
    data-dependent allocation: it captures, and a replay on new ids equals an eager run."""
    import json

    from ddtree.models import TargetConfig, random_target

    raw = json.loads(tiny_config(kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=64).to_json_string())
    model = random_target(TargetConfig.from_dict(raw), dtype=torch.bfloat16, device="cuda", std=0.05)
    bt = shuffled_block_table(2, 8, seed=6).cuda()
    caches = model.new_cache(bt.numel() + 3, PAGE)
    meta = _chain_meta(bt.cpu(), [9, 13], 5)
    meta = ForwardMeta(**{k: v.cuda() for k, v in vars(meta).items()})
    ids = torch.zeros(2, 5, dtype=torch.long, device="cuda")
    model.forward_paged(ids, meta, caches)  # compile the kernels outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured, _ = model.forward_paged(ids, meta, caches)
    ids.copy_(torch.randint(0, 96, (2, 5), device="cuda"))
    graph.replay()
    eager, _ = model.forward_paged(ids, meta, caches)
    assert torch.equal(captured, eager), (captured - eager).abs().max()  # the forward is deterministic


@torch.no_grad()
def test_padding_rows_and_missing_pages_never_write_into_a_request(target):
    """Rows past num_rows, and rows whose block-table entry is -1, write only to the scratch page:
    every other slot keeps its NaN poison, and the valid rows' slots are all written."""
    bt = torch.tensor([[2, 0, -1, -1], [1, 3, -1, -1]], dtype=torch.int32)  # page 4 spare, page 5 scratch
    caches = target.new_cache(5, PAGE)
    prefix = {(2, 0), (2, 1), (2, 2), (1, 0), (1, 1), (1, 2), (1, 3), (3, 0)}  # (page, offset)
    for cache in caches:
        cache.fill_(float("nan"))
        for page, offset in prefix:
            cache[page, offset] = torch.randn(cache.shape[-1])
    ids = torch.randint(0, 96, (2, 6), generator=torch.Generator().manual_seed(7))
    # request 0: prefix 3, 4 valid rows (slots 3..6, pages 2 and 0); request 1: prefix 5, 2 valid
    # rows (slots 5, 6 on page 3), its padding rows 2..5 would reach slots 7..10 (page 3, then -1).
    meta = _chain_meta(bt, [3, 5], 6, num_rows=[4, 2], scratch_page=5)
    logits, _ = target.forward_paged(ids, meta, caches)
    assert torch.isfinite(logits[0, :4]).all() and torch.isfinite(logits[1, :2]).all()
    written = prefix | {(2, 3), (0, 0), (0, 1), (0, 2), (3, 1), (3, 2)}
    for cache in caches:
        for page in range(5):
            for offset in range(PAGE):
                is_nan = bool(torch.isnan(cache[page, offset]).all())
                assert is_nan != ((page, offset) in written), (page, offset)
        assert torch.isfinite(cache[5]).all()  # the scratch page took the padding rows
