"""merge_project (split-KV merge + W_UV in one launch) against a float64 merge and matmul, and,
behind tree_verify_mla's merge=False, against the merged attention times W_UV. Outputs start as
NaN, so an unwritten element shows."""

from __future__ import annotations

import pytest
import torch

from ddtree.attention import tree_verify_mla
from ddtree.models.merge_project import merge_project
from ddtree.models.skinny import MAX_ROWS

from ..attention.cases import Case, make_inputs


def reference(part, part_lse, w_uv) -> torch.Tensor:
    """float64: softmax-weighted sum of the splits (empty splits weigh 0; rows with no key give 0),
    rounded to w_uv's dtype, times W_UV per head."""
    lse = part_lse.double()
    top = lse.amax(-1, keepdim=True).nan_to_num(0.0, neginf=0.0)
    weight = (lse - top).exp()
    total = weight.sum(-1, keepdim=True)
    merged = (part.double() * weight[..., None]).sum(2) / torch.where(total > 0, total, 1.0)
    return torch.einsum("mhc,hcv->mhv", merged.to(w_uv.dtype).double(), w_uv.double())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("rows,heads,splits,latent,values", [(1, 3, 5, 200, 40), (MAX_ROWS, 2, 1, 128, 32), (4, 2, 18, 64, 70)])
def test_matches_float64_merge_and_matmul(rows, heads, splits, latent, values, dtype, kernel_device):
    gen = torch.Generator().manual_seed(rows * splits)
    part = torch.randn(rows, heads, splits, latent, generator=gen)
    part_lse = torch.randn(rows, heads, splits, generator=gen) * 3
    if splits > 1:
        part_lse[:, :, -1] = float("-inf")  # an empty split (zeros, as the kernel leaves it) weighs nothing
        part[:, :, -1] = 0.0
    part_lse[-1, 0] = float("-inf")  # a row with no key at all (padding): out is 0
    w_kv_b = (torch.randn(heads, 8 + values, latent, generator=gen) / latent**0.5).to(dtype)
    w_uv = w_kv_b[:, 8:].transpose(1, 2)  # [H, C, V], unit stride in C: absorbed_attention's view
    out = torch.full((rows, heads, values), float("nan"), dtype=dtype)
    on = lambda t: t.to(kernel_device)  # noqa: E731
    got = merge_project(on(part), on(part_lse), on(w_uv), on(out)).cpu()
    want = reference(part, part_lse, w_uv)
    assert not torch.isnan(got).any(), "an output element was not written"
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    assert float((got.double() - want).norm() / want.norm()) < tol
    assert (got[-1, 0] == 0).all(), "a row with no key must come out as zeros"


def test_behind_tree_verify_equals_merged_attention_times_w_uv(kernel_device):
    """tree_verify_mla(merge=False) + merge_project = tree_verify_mla + W_UV, on a paged ragged batch
    (one padding row) with 3 splits."""
    case = Case(heads=4, prefixes=[40, 7], tree_rows=[3, 2], rows=3, chain=True, seed=4)
    q, kv, bt, pl, nn, vis = make_inputs(case, kernel_device)
    w_kv_b = (torch.randn(4, 8 + 16, 512, generator=torch.Generator().manual_seed(5)) / 512**0.5).bfloat16()
    w_uv = w_kv_b[:, 8:].transpose(1, 2).to(kernel_device)
    args = (q, kv, bt, pl, nn, vis, 0.1)
    merged, _ = tree_verify_mla(*args, num_splits=3, backend="triton")
    part, part_lse = tree_verify_mla(*args, num_splits=3, backend="triton", merge=False)
    assert part.shape == (2, 3, 4, 3, 512) and part.dtype == torch.float32 and part_lse.shape == (2, 3, 4, 3)
    rows = 2 * 3
    got = merge_project(part.view(rows, 4, 3, 512), part_lse.view(rows, 4, 3), w_uv).cpu().double()
    want = torch.einsum("mhc,hcv->mhv", merged.view(rows, 4, 512).cpu().double(), w_uv.cpu().double())
    valid = torch.tensor([True, True, True, True, True, False])  # request 1's third row is padding
    assert float((got[valid] - want[valid]).norm() / want[valid].norm()) < 2e-2
    assert (got[~valid] == 0).all()


def test_rejects_bad_inputs(kernel_device):
    part = torch.zeros(2, 3, 4, 32, device=kernel_device)
    lse = torch.zeros(2, 3, 4, device=kernel_device)
    w_uv = torch.zeros(3, 32, 8, device=kernel_device)
    with pytest.raises(ValueError, match=r"w_uv must be \[H=3, C=32, V\]"):
        merge_project(part, lse, w_uv[:, :16])
    with pytest.raises(ValueError, match=f"at most {MAX_ROWS} rows"):
        merge_project(torch.zeros(MAX_ROWS + 1, 3, 4, 32, device=kernel_device),
                      torch.zeros(MAX_ROWS + 1, 3, 4, device=kernel_device), w_uv)
    with pytest.raises(ValueError, match="float32"):
        merge_project(part, lse.double(), w_uv)


@pytest.mark.cuda
@torch.no_grad()
def test_decode_forward_with_the_merge_fused_equals_it_apart(monkeypatch):
    """On CUDA (the only place attention runs the kernel): a bf16 decode step of a target with
    MLA's real latent width gives the same logits with merge_project switched on as off."""
    from ddtree.models import TargetConfig, merge_project as module, random_target
    from ddtree.models.paged import ForwardMeta
    from ddtree.tree import pack_visibility

    cfg = TargetConfig.from_dict(dict(
        vocab_size=64, hidden_size=128, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, n_shared_experts=1, n_routed_experts=4, routed_scaling_factor=2.5, kv_lora_rank=512,
        q_lora_rank=None, qk_rope_head_dim=64, v_head_dim=32, qk_nope_head_dim=32, num_experts_per_tok=2,
        first_k_dense_replace=1, max_position_embeddings=4096))
    model = random_target(cfg, dtype=torch.bfloat16, std=0.05, device="cuda")
    caches = model.new_cache(8, 64)
    for cache in caches:
        cache.normal_()
    prefix = torch.tensor([300, 90], dtype=torch.int32, device="cuda")
    meta = ForwardMeta.build(torch.arange(8, dtype=torch.int32, device="cuda").view(2, 4), prefix,
                             torch.ones(2, dtype=torch.int32, device="cuda"), prefix.long()[:, None],
                             pack_visibility(torch.ones(2, 1, 1, dtype=torch.bool, device="cuda")),
                             page_size=64, scratch_page=8)
    ids = torch.tensor([[3], [7]], device="cuda")
    want, _ = model.forward_paged(ids, meta, [c.clone() for c in caches])
    monkeypatch.setattr(module, "FUSE_MERGE", True)
    calls = []
    real = module.merge_project
    monkeypatch.setattr(module, "merge_project", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    got, _ = model.forward_paged(ids, meta, [c.clone() for c in caches])
    assert len(calls) == cfg.num_hidden_layers, "every layer's attention must take merge_project"
    torch.testing.assert_close(got, want, rtol=5e-2, atol=5e-2)
