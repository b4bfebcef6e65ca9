"""fused_route (ops/router.py) against its reference route_reference: ids equal, ties included, weights
to float32 rounding; outputs start as NaN / -7 so an unwritten element shows. Then Router's and
MoE's switch."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import pytest
import torch

from ddtree.models import TargetConfig
from ddtree.models import layers as moe_module
from ddtree.models.layers import Router
from ddtree.models.layers import MoE
from ddtree.ops import KERNELS, REFERENCE, KernelPolicy
from ddtree.ops.router import fused_route, route_reference, top_indices


def reference(router: Router, logits: torch.Tensor):
    cfg = router.cfg
    return route_reference(logits, router.e_score_correction_bias, cfg.num_experts_per_tok, scoring_func=cfg.scoring_func,
                           topk_method=cfg.topk_method, n_group=cfg.n_group, topk_group=cfg.topk_group,
                           norm_topk_prob=cfg.norm_topk_prob, routed_scaling_factor=cfg.routed_scaling_factor)

POISON_INT = -7


@dataclass
class Case:
    experts: int
    top_k: int
    n_group: int = 1
    topk_group: int = 1
    scoring_func: str = "sigmoid"  # sigmoid: noaux_tc with a bias; softmax: (group_limited_)greedy
    norm_topk_prob: bool = True
    seed: int = 0

    def config(self, hidden: int = 16) -> TargetConfig:
        method = "noaux_tc" if self.scoring_func == "sigmoid" else "group_limited_greedy" if self.n_group > 1 else "greedy"
        return TargetConfig.from_dict(dict(
            vocab_size=8, hidden_size=hidden, intermediate_size=32, num_hidden_layers=2, num_attention_heads=1,
            kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, n_routed_experts=self.experts,
            n_shared_experts=1, num_experts_per_tok=self.top_k, moe_intermediate_size=8, routed_scaling_factor=2.5,
            scoring_func=self.scoring_func, topk_method=method, n_group=self.n_group, topk_group=self.topk_group,
            norm_topk_prob=self.norm_topk_prob))

    def router(self) -> Router:
        router = Router(self.config())
        gen = torch.Generator().manual_seed(self.seed)
        with torch.no_grad():
            router.weight.copy_(torch.randn(router.weight.shape, generator=gen))
            if router.e_score_correction_bias is not None:  # on a grid of 0.05: equal logits keep ties
                router.e_score_correction_bias.copy_(torch.randint(-2, 3, (self.experts,), generator=gen) * 0.05)
        return router.eval()

    def logits(self) -> torch.Tensor:
        """float32 [5, E]: two continuous rows, two on a coarse grid (many equal logits, equal
        group scores), one constant row (every expert ties)."""
        gen = torch.Generator().manual_seed(self.seed + 1)
        e = self.experts
        return torch.cat([torch.randn(2, e, generator=gen) * 2, torch.randint(-2, 3, (2, e), generator=gen) * 0.5,
                          torch.full((1, e), 0.25)])


def run_kernel(router: Router, logits: torch.Tensor, device: str):
    cfg = router.cfg
    tokens, k = logits.shape[0], cfg.num_experts_per_tok
    out = (torch.full((tokens, k), float("nan"), device=device),
           torch.full((tokens, k), POISON_INT, dtype=torch.int64, device=device))
    bias = router.e_score_correction_bias
    weights, ids = fused_route(
        logits.to(device), None if bias is None else bias.detach().to(device), k, scoring_func=cfg.scoring_func,
        topk_method=cfg.topk_method, n_group=cfg.n_group, topk_group=cfg.topk_group,
        norm_topk_prob=cfg.norm_topk_prob, routed_scaling_factor=cfg.routed_scaling_factor, out=out)
    assert weights is out[0] and ids is out[1]
    return weights.cpu(), ids.cpu()


def assert_same_routing(got, want) -> None:
    (w_got, i_got), (w_want, i_want) = got, want
    assert not torch.isnan(w_got).any() and not (i_got == POISON_INT).any(), "an output element was not written"
    mismatch = (i_got != i_want).any(-1).nonzero().flatten().tolist()
    assert not mismatch, f"ids differ at tokens {mismatch}: {i_got[mismatch].tolist()} vs {i_want[mismatch].tolist()}"
    torch.testing.assert_close(w_got, w_want, rtol=1e-6, atol=1e-6)


def grid() -> list[Case]:
    """E x k x groups x scoring x norm; E = 8 has groups of one expert: no noaux_tc top two there."""
    cases = []
    for (e, k, (n_group, topk_group), scoring, norm) in itertools.product(
            (8, 64, 256), (1, 2, 6, 8), ((1, 1), (8, 4)), ("sigmoid", "softmax"), (True, False)):
        if e == 8 and n_group == 8 and scoring == "sigmoid":
            continue
        cases.append(Case(e, k, n_group, topk_group, scoring, norm, seed=len(cases)))
    return cases


CASES = grid() + [
    Case(384, 8),  # Kimi K2: E not a power of two
    Case(256, 8, 8, 4, seed=100),  # DeepSeek-V3
    Case(96, 6, 4, 2, seed=101),  # groups of 24: padded within each group
    Case(8, 8, 8, 4, "softmax", seed=102),  # k past the kept experts: masked ones by ascending id
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"E{c.experts}-k{c.top_k}-g{c.n_group}-{c.scoring_func}"
                         f"-{'norm' if c.norm_topk_prob else 'raw'}")
@torch.no_grad()
def test_fused_route_matches_router_reference(case, kernel_device):
    router = case.router()
    logits = case.logits()
    assert_same_routing(run_kernel(router, logits, kernel_device), reference(router, logits))


@pytest.mark.parametrize("n_group,topk_group,scoring_func,third", [
    (1, 1, "sigmoid", 0), (4, 2, "sigmoid", 4), (4, 2, "softmax", 0)])
@torch.no_grad()
def test_ties_go_to_the_lowest_index(n_group, topk_group, scoring_func, third, kernel_device):
    """Row 0: every expert ties, so the first groups and experts. Row 1 (groups of 4): group 2 leads
    with two equal experts; group 0 has one expert above group 1's two equal ones, so the top-2
    sum (noaux_tc) keeps group 1 (where expert 4 beats its equal 5) and the max (greedy) group 0."""
    router = Case(16, 3, n_group, topk_group, scoring_func).router()
    if router.e_score_correction_bias is not None:
        router.e_score_correction_bias.zero_()
    logits = torch.zeros(2, 16)
    logits[1, [9, 10]], logits[1, 0], logits[1, [4, 5]] = 1.0, 0.8, 0.6
    want = [[0, 1, 2], [9, 10, third]]
    assert reference(router, logits)[1].tolist() == want
    assert run_kernel(router, logits, kernel_device)[1].tolist() == want
    assert top_indices(torch.tensor([1.0, 3, 3, 2, 3, 3, 0, 3]), 3).tolist() == [1, 2, 4]


@torch.no_grad()
def test_router_forward_switch(monkeypatch, kernel_device):
    """Router.forward: the kernel (policy "kernels") equals the reference; on the CPU the automatic
    choice is the reference; the kernel refuses a forward that autograd needs."""
    router = Case(64, 6, 8, 4, seed=3).router().to(kernel_device)
    x = torch.randn(4, 16, device=kernel_device)
    router.policy = REFERENCE
    want = router(x)
    router.policy = KERNELS
    assert_same_routing(tuple(t.cpu() for t in router(x)), tuple(t.cpu() for t in want))

    calls = []
    monkeypatch.setattr(moe_module, "fused_route", lambda *a, **kw: calls.append(a) or want)
    router = router.cpu()
    router.policy = KernelPolicy()
    router(x.cpu())
    assert calls == []
    with torch.enable_grad():
        router(x.cpu())[0].sum().backward()  # automatic: PyTorch, with gradients
        assert router.weight.grad is not None
        router.policy = KERNELS
        with pytest.raises(RuntimeError, match="no backward"):
            router(x.cpu())


@pytest.mark.parametrize("experts_path", ["grouped", "fused"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@torch.no_grad()
def test_moe_with_fused_router_equals_reference(dtype, experts_path, kernel_device):
    """Either router feeds either experts path (fused_moe wants contiguous ids) the same routing."""
    case = Case(32, 4, 4, 2, seed=5)
    moe = MoE(case.config(hidden=24))
    gen = torch.Generator().manual_seed(6)
    for p in moe.parameters():
        p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    moe = moe.to(device=kernel_device, dtype=dtype).eval()
    moe.policy = KERNELS if experts_path == "fused" else REFERENCE  # the same experts path for both routers
    x = torch.randn(2, 3, 24, generator=gen).to(device=kernel_device, dtype=dtype)
    results = []
    for policy in (REFERENCE, KERNELS):
        moe.gate.policy = policy
        ids = []
        results.append((moe(x, router_ids=ids), ids))
    (want, want_ids), (got, got_ids) = results
    assert len(got_ids) == 1 and torch.equal(got_ids[0], want_ids[0])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("change,match", [
    (dict(logits=lambda t: t.double()), "logits must be float32"),
    (dict(logits=lambda t: t.t()), "contiguous in E"),
    (dict(bias=lambda t: t[:-1]), r"bias must be a contiguous float \[E=16\]"),
    (dict(top_k=17), r"top_k must be in \[1, E=16\]"),
    (dict(n_group=3), "n_group must divide E=16"),
    (dict(n_group=4, topk_group=5), r"topk_group must be in \[1, n_group=4\]"),
    (dict(n_group=16), "must be >= 2"),
    (dict(scoring_func="tanh"), "scoring_func must be"),
    (dict(out=lambda t: (torch.empty(16, 2, device=t.device), torch.empty(16, 2, dtype=torch.int32, device=t.device))),
     "out ids must be a contiguous torch.int64"),
])
def test_fused_route_rejects_bad_inputs(change, match, kernel_device):
    logits = torch.randn(16, 16, device=kernel_device)
    args = dict(logits=logits, bias=torch.zeros(16, device=kernel_device), top_k=2)
    for name, value in change.items():
        args[name] = value(args.get(name, logits)) if callable(value) else value
    with pytest.raises(ValueError, match=match):
        fused_route(args.pop("logits"), args.pop("bias"), args.pop("top_k"), **args)


def test_no_tokens(kernel_device):
    weights, ids = fused_route(torch.empty(0, 8, device=kernel_device), None, 2)
    assert weights.shape == ids.shape == (0, 2)


@pytest.mark.cuda
@torch.no_grad()
def test_router_on_cuda_takes_the_kernel_and_captures_in_a_graph(monkeypatch):
    """Automatic on CUDA without autograd; a graph replay on new logits equals an eager call, and
    the ids equal the PyTorch path's on a DeepSeek-V3-shaped router."""
    calls = []
    real = moe_module.fused_route
    monkeypatch.setattr(moe_module, "fused_route", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    router = Case(256, 8, 8, 4, seed=7).router().cuda()
    x = torch.randn(64, 16, device="cuda")
    got = router(x)  # the automatic choice
    assert calls == [1]
    router.policy = REFERENCE
    assert_same_routing(tuple(t.cpu() for t in got), tuple(t.cpu() for t in router(x)))
    logits = torch.randn(64, 256, device="cuda")
    bias = router.e_score_correction_bias.detach()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = fused_route(logits, bias, 8, n_group=8, topk_group=4)
    logits.copy_(torch.randn(64, 256, device="cuda"))
    graph.replay()
    eager = fused_route(logits, bias, 8, n_group=8, topk_group=4)
    assert torch.equal(captured[1], eager[1]) and torch.equal(captured[0], eager[0])
