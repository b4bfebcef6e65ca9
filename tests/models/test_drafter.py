"""The DFlash drafter: cached, batched forward against a plain re-statement of the DFlash
forward; checkpoint loading and mismatched-pair errors."""

import json

import pytest
import torch
from safetensors.torch import save_file

pytest.importorskip("transformers")

from ddtree.models import Drafter, DrafterConfig, load_drafter, load_target  # noqa: E402
from ddtree.models import layers as joint  # noqa: E402
from ddtree.ops import KernelPolicy, apply_policy  # noqa: E402

from .checkpoints import save_tiny, tiny_config  # noqa: E402

RAW = dict(
    architectures=["DFlashDraftModel"], hidden_size=64, intermediate_size=80, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6, rope_theta=10000.0,
    vocab_size=96, dflash_config={"target_layer_ids": [0, 2], "block_size": 4, "mask_token_id": 95},
)


def _random_drafter(seed=0) -> Drafter:
    torch.manual_seed(seed)
    model = Drafter(DrafterConfig.from_dict(RAW))
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.1 * torch.randn_like(p))
    return model.float().eval()


def _rope(x, positions, theta):  # x [T, heads, d], positions [T]
    d = x.shape[-1]
    freqs = positions[:, None].double() / theta ** (torch.arange(0, d, 2).double() / d)
    cos, sin = torch.cat([freqs, freqs], -1).cos()[:, None], torch.cat([freqs, freqs], -1).sin()[:, None]
    return x * cos + torch.cat([-x[..., d // 2 :], x[..., : d // 2]], -1) * sin


def _norm(x, w, eps=1e-6):
    return w * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def dflash_reference(m: Drafter, features: torch.Tensor, block: torch.Tensor, positions=None) -> torch.Tensor:
    """One request, float64, no cache: features [C, F] of all committed tokens (positions 0..C-1),
    block embeddings [S, hidden] at positions C..C+S-1; non-causal attention over context + block.
    positions: int64 [C + S], other sequence positions of the context rows and the block."""
    cfg, dd = m.cfg, torch.float64
    w = {k: v.to(dd) for k, v in m.state_dict().items()}
    ctx = _norm(features.to(dd) @ w["fc.weight"].T, w["hidden_norm.weight"])
    c, s = ctx.shape[0], block.shape[0]
    pos = torch.arange(c + s) if positions is None else positions
    x = block.to(dd)
    for i in range(cfg.num_hidden_layers):
        p = f"layers.{i}."
        h = _norm(x, w[p + "input_layernorm.weight"])
        both = torch.cat([ctx, h])
        q = _rope(_norm((h @ w[p + "self_attn.q_proj.weight"].T).view(s, -1, cfg.head_dim), w[p + "self_attn.q_norm.weight"]), pos[c:], cfg.rope_theta)
        k = _rope(_norm((both @ w[p + "self_attn.k_proj.weight"].T).view(c + s, -1, cfg.head_dim), w[p + "self_attn.k_norm.weight"]), pos, cfg.rope_theta)
        v = (both @ w[p + "self_attn.v_proj.weight"].T).view(c + s, -1, cfg.head_dim)
        group = cfg.num_attention_heads // cfg.num_key_value_heads
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        att = torch.softmax(torch.einsum("shd,thd->hst", q, k) / cfg.head_dim**0.5, -1)
        x = x + torch.einsum("hst,thd->shd", att, v).reshape(s, -1) @ w[p + "self_attn.o_proj.weight"].T
        h = _norm(x, w[p + "post_attention_layernorm.weight"])
        gate, up = h @ w[p + "mlp.gate_proj.weight"].T, h @ w[p + "mlp.up_proj.weight"].T
        x = x + (torch.nn.functional.silu(gate) * up) @ w[p + "mlp.down_proj.weight"].T
    return _norm(x, w["norm.weight"])


@torch.no_grad()
def test_cached_batched_forward_matches_restatement():
    m = _random_drafter()
    gen = torch.Generator().manual_seed(1)
    feats = [torch.randn(8, 128, generator=gen), torch.randn(6, 128, generator=gen)]
    cache = m.new_cache(2, 16)
    # Round 1: 5 and 6 committed tokens; round 2: 3 more for request 0, none for request 1.
    first = torch.zeros(2, 6, 128)
    first[0, :5], first[1] = feats[0][:5], feats[1]
    m.append_context(cache, first, torch.tensor([5, 6]))
    second = torch.zeros(2, 3, 128)
    second[0] = feats[0][5:]
    m.append_context(cache, second, torch.tensor([3, 0]))
    assert cache.lengths.tolist() == [8, 6]
    block = torch.randn(2, 4, 64, generator=gen)  # embeddings of [bonus, mask, mask, mask]
    got = m(block, cache)
    for r in range(2):
        want = dflash_reference(m, feats[r], block[r])
        torch.testing.assert_close(got[r].double(), want, rtol=1e-5, atol=1e-5)


def test_load_and_pair_checks(tmp_path):
    target_dir, drafter_dir = tmp_path / "target", tmp_path / "drafter"
    save_tiny(target_dir, tiny_config())
    target = load_target(target_dir, dtype=torch.float32)
    drafter_dir.mkdir()
    m = _random_drafter(seed=2)
    save_file({k: v.contiguous() for k, v in m.state_dict().items()}, drafter_dir / "model.safetensors")
    (drafter_dir / "config.json").write_text(json.dumps(RAW))
    loaded = load_drafter(drafter_dir, target)  # dtype and device follow the target's
    assert loaded.fc.weight.dtype == torch.float32 and loaded.fc.weight.device == target.lm_head.weight.device
    for k, v in m.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v), k
    for layer in loaded.layers:  # the loader joined every MLP's gate and up weights and q, k, v
        attn = layer.self_attn
        for parts in [(layer.mlp.gate_proj, layer.mlp.up_proj), (attn.q_proj, attn.k_proj, attn.v_proj)]:
            assert joint.joint_weight(*parts) is None  # autograd on: one GEMM each
            with torch.no_grad():
                assert joint.joint_weight(*parts) is not None
    with torch.no_grad():  # one GEMM (loaded) against one each (m): same drafted hidden states
        feats, block = torch.randn(1, 5, 128), torch.randn(1, 4, 64)
        got, want = (d(block, _context(d, feats)) for d in (loaded, m))
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    for change, match in [
        ({"hidden_size": 48}, "hidden_size 48 != target hidden_size 64"),
        ({"vocab_size": 100}, "vocab_size 100 != target vocab_size 96"),
        ({"dflash_config": {"target_layer_ids": [0, 3], "block_size": 4, "mask_token_id": 95}}, r"target_layer_ids \[3\] out of range"),
        ({"dflash_config": {"target_layer_ids": [2, 0], "block_size": 4, "mask_token_id": 95}}, r"\[2, 0\] must be strictly increasing"),
        ({"dflash_config": {"target_layer_ids": [1, 1], "block_size": 4, "mask_token_id": 95}}, r"\[1, 1\] must be strictly increasing"),
    ]:
        (drafter_dir / "config.json").write_text(json.dumps({**RAW, **change}))
        with pytest.raises(ValueError, match=match):
            load_drafter(drafter_dir, target, dtype=torch.float32)
    (drafter_dir / "config.json").write_text(json.dumps({k: v for k, v in RAW.items() if k != "dflash_config"}))
    with pytest.raises(ValueError, match="lacks dflash_config.mask_token_id"):
        load_drafter(drafter_dir, target)


def _context(m: Drafter, feats: torch.Tensor):
    """A cache of capacity 16 holding the context features [B, C, 128]."""
    cache = m.new_cache(feats.shape[0], 16)
    m.append_context(cache, feats, torch.full((feats.shape[0],), feats.shape[1]))
    return cache


def test_context_capacity_is_checked():
    m = _random_drafter()
    cache = m.new_cache(1, 4)
    m.append_context(cache, torch.zeros(1, 3, 128), torch.tensor([3]))
    with pytest.raises(ValueError, match="capacity 4 exceeded"):
        m.append_context(cache, torch.zeros(1, 2, 128), torch.tensor([1]))


@torch.no_grad()
def test_draft_logits_put_the_bonus_in_slot_0(tmp_path):
    """End to end from the target: features of the layers in target_layer_ids, the block
    [bonus, mask, mask, mask] with the bonus in slot 0, the target's lm_head over slots 1..3."""
    save_tiny(tmp_path, tiny_config())
    target = load_target(tmp_path, dtype=torch.float32)
    m = _random_drafter(seed=3)
    prompt = torch.randint(0, 95, (2, 7), generator=torch.Generator().manual_seed(4))
    _, hidden = target(prompt, hidden_layers=m.cfg.target_layer_ids)
    feats = torch.cat(hidden, dim=-1)  # [2, 7, 2 * hidden], layers in target_layer_ids order
    cache = m.new_cache(2, 16)
    m.append_context(cache, feats, torch.tensor([7, 7]))
    bonus = torch.tensor([5, 17])
    got = m.draft_logits(target, bonus, cache)
    assert got.shape == (2, 3, 96)
    for r in range(2):
        block = target.embed_tokens(torch.tensor([int(bonus[r]), 95, 95, 95]))
        want = target.lm_head(dflash_reference(m, feats[r], block)[1:].float())
        torch.testing.assert_close(got[r], want, rtol=1e-5, atol=1e-5)
    moved = m.draft_logits(target, torch.tensor([17, 5]), cache)  # the bonus matters
    assert not torch.allclose(moved[0], got[0])
    assert m.draft_logits(target, torch.zeros(0, dtype=torch.long), m.new_cache(0, 16)).shape == (0, 3, 96)


@torch.no_grad()
def test_kernel_path_matches_restatement(kernel_device):
    """Joined projections through the few-row GEMM (ops/gemm.py) and the norms' kernels, residual
    adds inside them: the same drafted hidden states as the float64 restatement."""
    ref, m = _random_drafter(seed=6), _random_drafter(seed=6)
    m.fuse_input_projections()
    apply_policy(m, KernelPolicy("kernels"))
    m = m.to(kernel_device)
    gen = torch.Generator().manual_seed(7)
    feats = torch.randn(2, 5, 128, generator=gen)
    cache = m.new_cache(2, 16)
    m.append_context(cache, feats.to(kernel_device), torch.tensor([5, 3], device=kernel_device))
    block = torch.randn(2, 4, 64, generator=gen)
    got = m(block.to(kernel_device), cache).cpu()
    for r, held in enumerate([5, 3]):
        torch.testing.assert_close(got[r].double(), dflash_reference(ref, feats[r, :held], block[r]), rtol=1e-5, atol=1e-5)


@torch.no_grad()
def test_context_is_read_in_place_and_appends_reach_chosen_rows():
    """append_context(rows=...) writes only the named slots; the block's keys land after the
    context (no concatenation), and a key_limit that covers the block gives the same output."""
    m = _random_drafter(seed=4)
    gen = torch.Generator().manual_seed(5)
    cache = m.new_cache(3, 32)
    feats = torch.randn(2, 6, 128, generator=gen)
    m.append_context(cache, feats, torch.tensor([6, 4]), rows=torch.tensor([2, 0]))
    assert cache.lengths.tolist() == [4, 0, 6]
    assert torch.equal(cache.keys[0][1], torch.zeros_like(cache.keys[0][1]))  # slot 1 untouched
    block = torch.randn(3, 4, 64, generator=gen)
    full = m(block, cache)
    trimmed = m(block, cache, key_limit=10)  # max length 6 + block 4
    torch.testing.assert_close(trimmed, full, rtol=1e-5, atol=1e-5)
    want = dflash_reference(m, feats[0], block[2])
    torch.testing.assert_close(full[2].double(), want, rtol=1e-5, atol=1e-5)


def test_a_kimi_k25_style_drafter_without_target_layers(tmp_path):
    """z-lab's DFlash drafters for Kimi K2.5 / K2.6 (block size 8, 8 query heads per key/value head)
    may leave the target layers to DFlash's reference rule: spread from layer 1 to the fourth from
    last, one per draft layer ([1, 12, 24, 35, 47, 58] for K2.5's 6 layers on 61)."""
    from ddtree.models.drafter_config import reference_layer_ids

    assert reference_layer_ids(61, 6) == [1, 12, 24, 35, 47, 58]
    assert reference_layer_ids(30, 1) == [15]
    raw = dict(RAW, num_attention_heads=8, num_key_value_heads=1, head_dim=8, num_hidden_layers=2,
               dflash_config={"block_size": 8, "mask_token_id": 95})
    target_dir = tmp_path / "target"
    save_tiny(target_dir, tiny_config(num_hidden_layers=8))
    target = load_target(target_dir, dtype=torch.float32)
    cfg = DrafterConfig.from_dict(raw).for_target(target.cfg)
    assert cfg.target_layer_ids == (1, 5) and cfg.block_size == 8
    torch.manual_seed(0)
    model = Drafter(cfg)
    (tmp_path / "drafter").mkdir()
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, tmp_path / "drafter" / "model.safetensors")
    (tmp_path / "drafter" / "config.json").write_text(json.dumps(raw))
    drafter = load_drafter(tmp_path / "drafter", target)
    assert drafter.cfg.target_layer_ids == (1, 5) and drafter.fc.weight.shape == (64, 128)
    for name, p in drafter.state_dict().items():
        torch.testing.assert_close(p, model.state_dict()[name].float())


@torch.no_grad()
def test_rows_left_out_of_the_context_keep_every_key_at_its_true_position():
    """A context that left committed rows out (DrafterCache.skipped: budget="auto"'s plain steps)
    is the reference's attention over the rows it holds, each at its sequence position, with the
    block after the last committed token: a gap is only keys that are not there."""
    m = _random_drafter(seed=6)
    gen = torch.Generator().manual_seed(7)
    feats, block = torch.randn(1, 10, 128, generator=gen), torch.randn(1, 4, 64, generator=gen)
    cache = m.new_cache(1, 32)
    cache.skipped = torch.tensor([0])
    m.append_context(cache, feats[:, :5], torch.tensor([5]))  # positions 0..4
    cache.skipped = torch.tensor([3])  # rows 5..7 left out
    m.append_context(cache, feats[:, 8:], torch.tensor([2]))  # positions 8, 9 at entries 5, 6
    assert cache.lengths.tolist() == [7] and cache.next_positions().tolist() == [10]
    got = m(block, cache)
    held = torch.tensor([0, 1, 2, 3, 4, 8, 9])
    want = dflash_reference(m, feats[0, held], block[0], torch.cat([held, torch.arange(10, 14)]))
    torch.testing.assert_close(got[0].double(), want, rtol=1e-5, atol=1e-5)
    whole = m.new_cache(1, 32)
    m.append_context(whole, feats, torch.tensor([10]))
    for k_gap, k_whole in zip(cache.keys, whole.keys):  # the held rows' keys are the whole context's
        torch.testing.assert_close(k_gap[0, :7], k_whole[0, held], rtol=1e-6, atol=1e-6)
