"""fused_moe against a float64 loop over (token, choice) and against grouped_moe, its reference; the
expert alignment against a plain Python reference. Buffers start as NaN (or -7) so that an
unwritten element or a stray read shows."""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

from ddtree.models import TargetConfig
from ddtree.models import layers as moe_module
from ddtree.models.layers import MoE
from ddtree.ops import KERNELS, REFERENCE, KernelPolicy
from ddtree.ops.moe import BLOCK_K, BLOCK_N, NARROW_TILES, SharedExperts, Workspace, block_m_for, fused_moe, tiles_for
from ddtree.ops.moe_align import NO_EXPERT, align_by_expert, max_blocks
from ddtree.ops.moe_grouped import grouped_moe

from ..conftest import CUDA_AND_INTERPRETED

POISON_INT = -7


# ---- the specifications ---------------------------------------------------------------------------

def moe_reference(x, w_gate_up, w_down, weights, ids, shared: SharedExperts | None = None) -> torch.Tensor:
    """float64 [T, hidden], one (token, choice) at a time: h = silu(x Wg) * (x Wu), rounded to
    x.dtype (the kernel stores it so), then out[t] = sum_j weights[t, j] * h Wd; plus, with
    `shared`, the shared MLP down(silu(gate x) * up x) with its intermediate rounded so."""
    tokens, top_k = ids.shape
    inter = w_down.shape[1]
    out = torch.zeros(tokens, x.shape[1], dtype=torch.float64)
    for t, j in itertools.product(range(tokens), range(top_k)):
        e = int(ids[t, j])
        gate_up = x[t].double() @ w_gate_up[e].double()
        h = (F.silu(gate_up[:inter]) * gate_up[inter:]).to(x.dtype).double()
        out[t] += float(weights[t, j]) * (h @ w_down[e].double())
    if shared is not None:
        xd = x.double()
        h = (F.silu(xd @ shared.gate.double().T) * (xd @ shared.up.double().T)).to(x.dtype).double()
        out += h @ shared.down.double().T
    return out


def make_shared(case, num_shared: int, dtype: torch.dtype, device: str, joint: bool = True) -> SharedExperts:
    """Shared MLP weights in nn.Linear layout, num_shared x the routed width; gate and up as views
    of one buffer (joint.join's layout) or apart."""
    gen = torch.Generator().manual_seed(case.seed + 2)
    width, h = num_shared * case.inter, case.hidden
    gate_up = (torch.randn(2 * width, h, generator=gen) / h**0.5).to(dtype=dtype, device=device)
    down = (torch.randn(h, width, generator=gen) / width**0.5).to(dtype=dtype, device=device)
    gate, up = (gate_up[:width], gate_up[width:]) if joint else (gate_up[:width].clone(), gate_up[width:].clone())
    return SharedExperts(gate, up, down)


def align_reference(ids: list[list[int]], num_experts: int, block_m: int, n_blocks: int):
    """(sorted_pairs, block_expert) as lists: each expert's pairs ascending, padded with P to a
    multiple of block_m, experts in order; then NO_EXPERT blocks of padding up to n_blocks."""
    flat = [e for row in ids for e in row]
    pad = len(flat)
    pairs, experts = [], []
    for e in range(num_experts):
        mine = [p for p, f in enumerate(flat) if f == e]
        blocks = math.ceil(len(mine) / block_m)
        pairs += mine + [pad] * (blocks * block_m - len(mine))
        experts += [e] * blocks
    assert len(experts) <= n_blocks, "max_blocks is not an upper bound"
    return pairs + [pad] * ((n_blocks - len(experts)) * block_m), experts + [NO_EXPERT] * (n_blocks - len(experts))


# ---- cases ----------------------------------------------------------------------------------------

@dataclass
class Case:
    tokens: int
    top_k: int
    experts: int
    hidden: int
    inter: int
    route: str = "random"  # random | same (every token the same experts) | all (every expert used) | few
    seed: int = 0

    def ids(self) -> torch.Tensor:
        """int64 [T, k], distinct experts per token (as the router's top-k)."""
        gen = torch.Generator().manual_seed(self.seed)
        t, k, e = self.tokens, self.top_k, self.experts
        if self.route == "same":
            return torch.randperm(e, generator=gen)[:k].expand(t, k).clone()
        if self.route == "all":
            assert t * k >= e
            return (torch.arange(t * k).view(t, k) + torch.randint(e, (t, 1), generator=gen)) % e
        pool = torch.arange(e) if self.route == "random" else torch.randperm(e, generator=gen)[: k + 1]
        return torch.stack([pool[torch.randperm(len(pool), generator=gen)[:k]] for _ in range(t)])


def make_inputs(case: Case, dtype: torch.dtype, device: str):
    """(x, w_gate_up, w_down, weights, ids). x is a column slice of a NaN-padded buffer (a K-mask
    miss reads NaN); the weights of experts no token chose are NaN (a wrong block expert shows)."""
    gen = torch.Generator().manual_seed(case.seed + 1)
    t, e, h, i = case.tokens, case.experts, case.hidden, case.inter
    x_wide = torch.full((t, h + 24), float("nan"))
    x_wide[:, :h] = torch.randn(t, h, generator=gen)
    w_gate_up = torch.randn(e, h, 2 * i, generator=gen) / h**0.5
    w_down = torch.randn(e, i, h, generator=gen) / i**0.5
    ids = case.ids()
    unused = torch.ones(e, dtype=torch.bool)
    unused[ids.flatten()] = False
    w_gate_up[unused] = float("nan")
    w_down[unused] = float("nan")
    weights = torch.rand(t, case.top_k, generator=gen) + 0.1
    x = x_wide.to(dtype=dtype, device=device)[:, :h]
    return x, w_gate_up.to(dtype=dtype, device=device), w_down.to(dtype=dtype, device=device), weights.to(device), ids.to(device)


def assert_close(got: torch.Tensor, want: torch.Tensor, tol: float) -> None:
    got, want = got.double().cpu(), want.double().cpu()
    assert not torch.isnan(got).any(), f"NaN at {torch.isnan(got).nonzero()[:5].tolist()} (unwritten or a stray read)"
    diff = (got - want).abs()
    worst = divmod(int(diff.argmax()), got.shape[-1])
    err = float((got - want).norm() / want.norm().clamp_min(1e-30))
    assert err < tol, f"relative error {err:.2e}; worst {float(diff.max()):.3e} at {worst}: {float(got[worst])} vs {float(want[worst])}"
    assert F.cosine_similarity(got.flatten(), want.flatten(), dim=0) > 1 - tol


# bf16: the interpreter truncates float32 -> bf16 (the GPU rounds to nearest), about 2^-8 relative.
TOL = {torch.float32: 1e-5, torch.bfloat16: 1.5e-2, torch.float16: 2e-3}

CASES = {
    "one_token": Case(1, 2, 5, 40, 24),
    "masked_tiles": Case(7, 3, 6, 200, 150, seed=1),  # two K steps of 128, three N tiles of 64
    "k1": Case(9, 1, 3, 48, 32, seed=2),
    "one_expert": Case(20, 1, 4, 32, 16, route="same", seed=7),  # every token to one expert: two blocks
    "same_experts": Case(20, 2, 5, 32, 16, route="same", seed=3),
    "every_expert": Case(6, 4, 11, 40, 24, route="all", seed=4),
    "unused_experts": Case(5, 2, 9, 40, 24, route="few", seed=5),
    # Enough pairs for the wide default tile (128 x 64) and a larger block_m (block_m_for):
    "block_m_64": Case(40, 2, 2, 72, 150, seed=9),  # 40 pairs per expert; two N tiles, the second masked
    "block_m_64_all": Case(70, 3, 4, 200, 260, route="all", seed=10),  # four K steps, the last masked
    "block_m_32": Case(33, 2, 3, 136, 136, seed=11),  # 22 pairs per expert
}


# ---- alignment ------------------------------------------------------------------------------------

@pytest.mark.parametrize("tokens,top_k,experts,block_m,route", [
    (1, 1, 1, 16, "random"), (1, 8, 384, 16, "random"), (5, 3, 7, 16, "random"), (40, 2, 4, 16, "random"),
    (33, 2, 6, 16, "same"), (12, 4, 13, 32, "all"), (64, 8, 384, 16, "random"), (6, 2, 9, 16, "few"),
    (9, 8, 384, 1, "random"), (65, 8, 384, 2, "random"), (33, 2, 6, 4, "same"),  # the INT4 row kernels' blocks
])
def test_alignment_matches_python_reference(tokens, top_k, experts, block_m, route, kernel_device):
    ids = Case(tokens, top_k, experts, 1, 1, route=route, seed=tokens).ids()
    n_blocks = max_blocks(ids.numel(), experts, block_m)
    out = (torch.full((n_blocks * block_m,), POISON_INT, dtype=torch.int32, device=kernel_device),
           torch.full((n_blocks,), POISON_INT, dtype=torch.int32, device=kernel_device))
    got = align_by_expert(ids.to(kernel_device), experts, block_m, out=out)
    want_pairs, want_experts = align_reference(ids.tolist(), experts, block_m, n_blocks)
    assert got.block_expert.tolist() == want_experts
    assert got.sorted_pairs.tolist() == want_pairs


def test_max_blocks_is_the_tight_bound():
    """Over every way to spread P pairs on E experts: the blocks used never pass max_blocks, and
    some spread reaches it."""
    for pairs, experts, block_m in itertools.product(range(1, 9), range(1, 5), (2, 3, 4)):
        most = max(sum(math.ceil(c / block_m) for c in counts)
                   for counts in itertools.product(range(pairs + 1), repeat=experts) if sum(counts) == pairs)
        assert most == max_blocks(pairs, experts, block_m), (pairs, experts, block_m)


# ---- the kernels ----------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("name", list(CASES))
def test_fused_moe_matches_float64_reference(name, dtype, kernel_device):
    case = CASES[name]
    x, w_gate_up, w_down, weights, ids = make_inputs(case, dtype, kernel_device)
    ws = Workspace.empty(case.tokens, case.top_k, case.experts, case.hidden, case.inter, dtype, kernel_device)
    for buf in (ws.h, ws.y):
        buf.fill_(float("nan"))
    ws.sorted_pairs.fill_(POISON_INT)
    ws.block_expert.fill_(POISON_INT)
    out = torch.full((case.tokens, case.hidden), float("nan"), dtype=dtype, device=kernel_device)
    fused_moe(x, w_gate_up, w_down, weights, ids, out=out, workspace=ws)
    assert not torch.isnan(ws.h).any() and not torch.isnan(ws.y).any(), "a (token, choice) row was not written"
    assert_close(out, moe_reference(x.cpu(), w_gate_up.cpu(), w_down.cpu(), weights.cpu(), ids.cpu()), TOL[dtype])


SHARED_CASES = {
    "decode_two_shared": (Case(1, 2, 5, 40, 24), 2, True),
    "masked_tiles_one_shared": (Case(7, 3, 6, 200, 150, seed=1), 1, False),  # gate and up apart
    # 40 tokens at block_m 64 (block_m_64): one shared block per expert, its rows partly masked.
    "block_m_64_three_shared": (Case(40, 2, 2, 72, 150, seed=9), 3, True),
    "many_token_blocks": (Case(37, 1, 3, 48, 32, seed=12), 2, True),  # three 16-row blocks per shared expert
}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("name", list(SHARED_CASES))
def test_fused_moe_with_shared_experts_matches_float64_reference(name, dtype, kernel_device):
    case, num_shared, joint = SHARED_CASES[name]
    x, w_gate_up, w_down, weights, ids = make_inputs(case, dtype, kernel_device)
    shared = make_shared(case, num_shared, dtype, kernel_device, joint)
    ws = Workspace.empty(case.tokens, case.top_k, case.experts, case.hidden, case.inter, dtype, kernel_device,
                         num_shared=num_shared)
    for buf in (ws.h, ws.y):
        buf.fill_(float("nan"))
    out = torch.full((case.tokens, case.hidden), float("nan"), dtype=dtype, device=kernel_device)
    fused_moe(x, w_gate_up, w_down, weights, ids, shared=shared, out=out, workspace=ws)
    assert not torch.isnan(ws.h).any() and not torch.isnan(ws.y).any(), "a routed or shared row was not written"
    cpu = SharedExperts(shared.gate.cpu(), shared.up.cpu(), shared.down.cpu())
    want = moe_reference(x.cpu(), w_gate_up.cpu(), w_down.cpu(), weights.cpu(), ids.cpu(), cpu)
    assert_close(out, want, TOL[dtype])
    routed_only = moe_reference(x.cpu(), w_gate_up.cpu(), w_down.cpu(), weights.cpu(), ids.cpu())
    assert (want - routed_only).norm() > 0.1 * want.norm(), "the shared experts must move the result"


def test_shared_experts_only(kernel_device):
    """k = 0 routed choices: out is the shared MLP alone."""
    case = Case(3, 0, 4, 40, 24, seed=13)
    x, w_gate_up, w_down, weights, ids = make_inputs(case, torch.float32, kernel_device)
    shared = make_shared(case, 1, torch.float32, kernel_device)
    out = fused_moe(x, w_gate_up.nan_to_num(0.0), w_down.nan_to_num(0.0), weights, ids, shared=shared)
    cpu = SharedExperts(shared.gate.cpu(), shared.up.cpu(), shared.down.cpu())
    assert_close(out, moe_reference(x.cpu(), w_gate_up.cpu(), w_down.cpu(), weights.cpu(), ids.cpu(), cpu), 1e-5)


def test_tile_choice():
    """Narrow tiles while the gate_up launch would leave SMs idle; block_m from pairs per expert."""
    assert tiles_for(6, 1408) == NARROW_TILES  # a Moonlight decode token: 6 x 11 programs
    assert tiles_for(8, 2048) == (BLOCK_N, BLOCK_K)  # a Kimi K2 decode token: 8 x 16 = 128
    assert [block_m_for(p, 64) for p in (6, 390, 1100, 3120, 8000)] == [16, 16, 32, 64, 64]
    assert block_m_for(4160, 384) == 16


def test_small_tiles_and_fp16(kernel_device):
    """16-wide tiles: many K steps and N tiles per program, the last of each masked."""
    case = Case(3, 2, 4, 50, 40, seed=6)
    x, w_gate_up, w_down, weights, ids = make_inputs(case, torch.float16, kernel_device)
    out = fused_moe(x, w_gate_up, w_down, weights, ids, block_n=16, block_k=16)
    assert_close(out, moe_reference(x.cpu(), w_gate_up.cpu(), w_down.cpu(), weights.cpu(), ids.cpu()), TOL[torch.float16])


def test_no_tokens(kernel_device):
    x, w_gate_up, w_down, weights, ids = make_inputs(Case(1, 2, 5, 40, 24), torch.float32, kernel_device)
    out = fused_moe(x[:0], w_gate_up, w_down, weights[:0], ids[:0])
    assert out.shape == (0, 40)


def zero_shared(device, gate, up, down, dtype=torch.bfloat16, strided_up=False) -> SharedExperts:
    """SharedExperts of zeros with the given shapes; strided_up: up as every other column of a wider buffer."""
    def make(shape):
        return torch.zeros(shape, dtype=dtype, device=device)
    return SharedExperts(make(gate), make((up[0], 2 * up[1]))[:, ::2] if strided_up else make(up), make(down))


@pytest.mark.parametrize("change,match", [
    (lambda a, dev: a.update(ids=a["ids"].int()), "ids must be torch.int64"),
    (lambda a, dev: a.update(weights=a["weights"].double()), "weights must be torch.float32"),
    (lambda a, dev: a.update(w_down=a["w_down"].float()), r"w_down must be torch.bfloat16 \(x.dtype\)"),
    (lambda a, dev: a.update(w_down=a["w_down"][:, :-1]), r"w_down must be \[E, inter, hidden\]"),
    (lambda a, dev: a.update(w_gate_up=a["w_gate_up"].transpose(1, 2).contiguous().transpose(1, 2)), "w_gate_up must be contiguous"),
    (lambda a, dev: a.update(weights=a["weights"][:, :1]), "weights must have the shape of ids"),
    (lambda a, dev: a.update(x=a["x"][None]), r"x must be \[T, hidden\]"),
    (lambda a, dev: a.update(ids=a["ids"].to("meta")), "ids is on meta"),
    (lambda a, dev: a.update(out=torch.empty(2, 32, device=dev)), "out must be a contiguous torch.bfloat16"),
    (lambda a, dev: a.update(workspace=Workspace.empty(2, 2, 5, 32, 16, torch.float32, dev)), "workspace.h must be"),
    (lambda a, dev: a.update(shared=zero_shared(dev, (24, 32), (24, 32), (32, 24))), r"shared.gate must be \[S \* inter"),
    (lambda a, dev: a.update(shared=zero_shared(dev, (32, 32), (32, 32), (16, 32))), r"shared.down must be \[32, 32\]"),
    (lambda a, dev: a.update(shared=zero_shared(dev, (16, 32), (16, 32), (32, 16), dtype=torch.float32)),
     r"shared.gate must be torch.bfloat16 \(x.dtype\)"),
    (lambda a, dev: a.update(shared=zero_shared(dev, (16, 32), (16, 32), (32, 16), strided_up=True)),
     "shared.up must be contiguous"),
])
def test_fused_moe_rejects_bad_inputs(change, match, kernel_device):
    x, w_gate_up, w_down, weights, ids = make_inputs(Case(2, 2, 5, 32, 16), torch.bfloat16, kernel_device)
    args = dict(x=x, w_gate_up=w_gate_up, w_down=w_down, weights=weights, ids=ids)
    change(args, kernel_device)  # on the kernel's device, so each case fails its own check, not the device's
    with pytest.raises((ValueError, TypeError), match=match):
        fused_moe(**args)


# ---- MoE.forward's switch ---------------------------------------------------------------------------

def make_moe(dtype: torch.dtype, experts: int = 10, top_k: int = 3, hidden: int = 72, inter: int = 40,
             shared: int = 1, joint: bool = False) -> MoE:
    raw = dict(vocab_size=8, hidden_size=hidden, intermediate_size=64, num_hidden_layers=2, num_attention_heads=1,
               kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, n_routed_experts=experts,
               n_shared_experts=shared, num_experts_per_tok=top_k, moe_intermediate_size=inter,
               routed_scaling_factor=2.5)
    moe = MoE(TargetConfig.from_dict(raw))
    if joint:
        moe.shared_experts.fuse_input_projections()
    gen = torch.Generator().manual_seed(experts)
    with torch.no_grad():
        for p in moe.parameters():  # router bias [E]; nn.Linear [out, in]; experts [E, in, out]
            scale = 0.1 if p.dim() == 1 else p.shape[-1 if p.dim() == 2 else -2] ** -0.5
            p.copy_(torch.randn(p.shape, generator=gen) * scale)
    return moe.to(dtype).eval()


@pytest.mark.parametrize("case", [Case(5, 3, 10, 72, 40, seed=3), Case(9, 2, 4, 32, 16, route="same", seed=4),
                                  Case(1, 4, 8, 40, 24, seed=5)], ids=str)
def test_grouped_moe_equals_the_float64_loop(case):
    """The reference path, itself against the specification (float32, experts no token chose
    left NaN: grouped_moe must not read them)."""
    x, w_gate_up, w_down, weights, ids = make_inputs(case, torch.float32, "cpu")
    got = grouped_moe(x, w_gate_up, w_down, weights, ids)
    assert_close(got, moe_reference(x, w_gate_up, w_down, weights, ids), 1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("shared,joint", [(1, False), (2, True), (0, False)])
@torch.no_grad()
def test_moe_fused_path_equals_grouped_path(dtype, shared, joint, kernel_device, monkeypatch):
    moe = make_moe(dtype, shared=shared, joint=joint).to(kernel_device)
    x = torch.randn(2, 3, 72, generator=torch.Generator().manual_seed(1)).to(dtype=dtype, device=kernel_device)
    moe.policy = REFERENCE
    want = moe(x)
    moe.policy = KERNELS
    if shared:  # the fused path adds the shared experts inside its own launches, not through the MLP
        monkeypatch.setattr(moe.shared_experts, "forward", lambda *a: pytest.fail("shared MLP ran on its own"))
    got = moe(x)
    # The grouped path also rounds gate, up and each expert's output to x.dtype.
    assert_close(got.flatten(0, 1), want.flatten(0, 1), 2e-2 if dtype == torch.bfloat16 else 1e-5)


def test_moe_switch_on_cpu(monkeypatch):
    """On the CPU the automatic choice is the grouped path; the "kernels" policy opts in and
    refuses a forward that autograd needs."""
    calls = []
    monkeypatch.setattr(moe_module, "fused_moe", lambda *args, **kw: calls.append(args) or torch.zeros_like(args[0]))
    moe = make_moe(torch.float32)
    x = torch.randn(4, 72)
    with torch.no_grad():
        moe(x)
        assert calls == []
        moe.policy = KERNELS
        moe(x)
        assert len(calls) == 1
    with pytest.raises(RuntimeError, match="no backward"):
        moe(x)
    moe.policy = KernelPolicy()
    moe(x).sum().backward()  # the automatic choice keeps autograd on the grouped path
    assert moe.w_down.grad is not None and len(calls) == 1


def test_fused_path_refuses_a_forward_that_trains_only_the_shared_experts():
    """The fused path reads the shared MLP's weights too: a gradient wanted for them alone must
    not be dropped silently (forced: an error; automatic: the grouped path keeps autograd)."""
    moe = make_moe(torch.float32)
    for p in (moe.w_gate_up, moe.w_down, *moe.gate.parameters()):
        p.requires_grad_(False)
    x = torch.randn(3, 72)
    moe.policy = KERNELS
    with pytest.raises(RuntimeError, match="no backward"):
        moe(x)
    moe.policy = KernelPolicy()
    moe(x).sum().backward()
    assert moe.shared_experts.down_proj.weight.grad is not None


@pytest.mark.parametrize("device", CUDA_AND_INTERPRETED)
@torch.no_grad()
def test_automatic_moe_takes_the_fused_path_up_to_the_threshold(device, monkeypatch):
    """The automatic policy runs the fused kernels for up to moe_fused_max_tokens tokens and the
    grouped GEMMs above: on CUDA the default policy and limit; on the CPU a policy whose "auto"
    takes the (interpreted) kernels there too, with a small limit. Both equal the reference path."""
    calls = []
    real = moe_module.fused_moe
    monkeypatch.setattr(moe_module, "fused_moe", lambda *args, **kw: calls.append(args[0].shape[0]) or real(*args, **kw))
    moe = make_moe(torch.bfloat16).to(device)
    if device == "cpu":
        moe.policy = KernelPolicy(auto_devices=("cuda", "cpu"), moe_fused_max_tokens=3)
    auto, limit = moe.policy, moe.policy.moe_fused_max_tokens
    gen = torch.Generator().manual_seed(limit)
    for tokens in (1, limit, limit + 1):
        x = torch.randn(tokens, 72, generator=gen).to(device=device, dtype=torch.bfloat16)
        got = moe(x)
        moe.policy = REFERENCE
        assert_close(got, moe(x), TOL[torch.bfloat16])
        moe.policy = auto
    assert calls == [1, limit]


@pytest.mark.cuda
@torch.no_grad()
def test_fused_moe_captures_in_a_cuda_graph():
    """No host sync and static sizes: it captures, and a replay on new ids equals an eager run."""
    case = Case(16, 8, 64, 256, 192, seed=7)
    x, w_gate_up, w_down, weights, ids = make_inputs(case, torch.bfloat16, "cuda")
    w_gate_up, w_down = w_gate_up.nan_to_num(0.0), w_down.nan_to_num(0.0)
    fused_moe(x, w_gate_up, w_down, weights, ids)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = fused_moe(x, w_gate_up, w_down, weights, ids)
    ids.copy_(Case(16, 8, 64, 1, 1, seed=8).ids())
    graph.replay()
    assert torch.equal(captured, fused_moe(x, w_gate_up, w_down, weights, ids))


@pytest.mark.parametrize("tokens", [1, 6])  # one token: the direct mode; six: aligned blocks
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_pairs_of_other_ranks_experts_add_nothing(tokens, dtype, kernel_device):
    """Expert parallelism hands each rank the router's choices with other ranks' experts as -1
    (or past E): both paths drop those pairs, so the rows sum only this rank's experts."""
    case = Case(tokens, 3, 6, 40, 24, seed=40 + tokens)
    x, w_gate_up, w_down, weights, ids = make_inputs(case, dtype, kernel_device)
    w_gate_up, w_down = w_gate_up.nan_to_num(0.0), w_down.nan_to_num(0.0)
    drop = torch.rand(ids.shape, generator=torch.Generator().manual_seed(tokens)) < 0.4
    drop[0, 0] = True
    theirs = ids.cpu().masked_fill(drop, -1)
    theirs[0, 0] = case.experts + 2  # past E: dropped too
    theirs = theirs.to(kernel_device)
    kept = weights.cpu().masked_fill(drop, 0.0)
    want = moe_reference(x.cpu(), w_gate_up.cpu(), w_down.cpu(), kept, ids.masked_fill(drop.to(ids.device), 0).cpu())
    got = fused_moe(x, w_gate_up, w_down, weights, theirs, out=torch.full_like(x, float("nan")))
    assert_close(got, want, TOL[dtype])
    assert_close(grouped_moe(x.cpu(), w_gate_up.cpu(), w_down.cpu(), weights.cpu(), theirs.cpu()), want, TOL[dtype])
