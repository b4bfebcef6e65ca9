"""INT4 experts in the group-interleaved order (ops/int4.interleave_int4, ops/int4_interleaved.py):
the order is the documented permutation, dequantizes to the same weights, and fused_moe's
interleaved tiles match the float64 loop; what the order cannot take is refused by name."""

from __future__ import annotations

import pytest
import torch

from ddtree.ops import moe_int4
from ddtree.ops.int4 import (PackedInt4, dequantize_int4, interleave_int4, interleave_order, quantize_int4,
                             unpack_int4)
from ddtree.ops.moe import Workspace, fused_moe
from ddtree.ops.moe_grouped import grouped_moe

from .test_int4 import dense, int4_experts
from .test_moe import POISON_INT, TOL, Case, assert_close, make_shared, moe_reference


def test_each_value_sits_where_the_order_says():
    w = quantize_int4(torch.randn(2, 3, 512), 32)
    values = unpack_int4(interleave_int4(w).packed)  # [2, 3, 512] in word order
    columns = unpack_int4(w.packed)
    for k in (0, 1, 2, 31, 32, 33, 127, 128, 200, 255, 256, 300, 511):
        block, g, r = k // 256, (k % 256) // 32, k % 32
        word = block * 32 + 16 * (g // 4) + r // 2
        nibble = g % 4 + 4 * (r % 2)
        assert torch.equal(values[..., 8 * word + nibble], columns[..., k]), k
    assert sorted(interleave_order().tolist()) == list(range(256))


def test_interleaved_weights_dequantize_to_the_same_weights():
    w = quantize_int4(torch.randn(4, 6, 768), 32)
    wi = interleave_int4(w)
    assert wi.interleaved and not torch.equal(wi.packed, w.packed) and wi.scale is w.scale
    assert torch.equal(dequantize_int4(wi, torch.float32), dequantize_int4(w, torch.float32))
    assert interleave_int4(wi) is wi


CASES = [Case(1, 3, 5, 256, 256, seed=21), Case(6, 2, 4, 512, 256, seed=22),
         Case(12, 4, 6, 256, 512, route="all", seed=23)]


@pytest.mark.parametrize("case, block_m", [(CASES[0], 16), (CASES[1], 16), (CASES[2], 16), (CASES[2], 64)],
                         ids=["T1", "T6", "T12", "T12-block64"])
@pytest.mark.parametrize("num_shared", [0, 1])
def test_interleaved_experts_match_the_float64_loop(case, block_m, num_shared, kernel_device):
    x, gate_up, down, weights, ids = int4_experts(case, torch.bfloat16, kernel_device, group=32)
    shared = make_shared(case, num_shared, torch.bfloat16, kernel_device) if num_shared else None
    gi, di = interleave_int4(gate_up), interleave_int4(down)
    ws = Workspace.empty(case.tokens, case.top_k, case.experts, case.hidden, case.inter, torch.bfloat16,
                         kernel_device, block_m=block_m, num_shared=num_shared)
    ws.sorted_pairs.fill_(POISON_INT)
    for buf in (ws.h, ws.y):
        buf.fill_(float("nan"))
    got = fused_moe(x, gi, di, weights, ids, shared=shared, workspace=ws, block_m=block_m)
    assert moe_int4.int4_unpack(x, gi, di).startswith("interleaved")
    assert not got.isnan().any()
    cpu = lambda t: t.cpu()  # noqa: E731
    want = moe_reference(cpu(x), cpu(dense(gate_up, x.dtype)), cpu(dense(down, x.dtype)), cpu(weights), cpu(ids),
                         None if shared is None else type(shared)(*(cpu(t) for t in (shared.gate, shared.up, shared.down))))
    assert_close(got, want, TOL[torch.bfloat16])
    if not num_shared:  # the reference path dequantizes either order to the same weights
        assert torch.equal(grouped_moe(cpu(x), *(PackedInt4(cpu(w.packed), cpu(w.scale), 32, w.interleaved)
                                                  for w in (gi, di)), cpu(weights), cpu(ids)),
                           grouped_moe(cpu(x), *(PackedInt4(cpu(w.packed), cpu(w.scale), 32) for w in (gate_up, down)),
                                       cpu(weights), cpu(ids)))


@pytest.mark.parametrize("case, block_m", [(CASES[1], 16), (CASES[2], 64)], ids=["T6", "T12-block64"])
def test_half_block_steps_match_the_float64_loop(case, block_m, kernel_device, monkeypatch):
    """INT4_INTERLEAVED_STEP 128: each K step multiplies half an interleaved block (its 16 words and 4
    scales); the same sums as the float64 loop, with a shared expert beside the routed ones."""
    import ddtree.ops.moe as moe

    monkeypatch.setattr(moe_int4, "INT4_INTERLEAVED_STEP", 128)
    steps = []

    class Recording:  # the STEP each launch compiles with
        def __init__(self, kernel):
            self.kernel = kernel

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                steps.append((kwargs["UNPACK"], kwargs["STEP"]))
                return self.kernel[grid](*args, **kwargs)
            return launch

    for name in ("gate_up_kernel", "down_kernel"):
        monkeypatch.setattr(moe, name, Recording(getattr(moe, name)))
    x, gate_up, down, weights, ids = int4_experts(case, torch.bfloat16, kernel_device, group=32)
    shared = make_shared(case, 1, torch.bfloat16, kernel_device)
    ws = Workspace.empty(case.tokens, case.top_k, case.experts, case.hidden, case.inter, torch.bfloat16,
                         kernel_device, block_m=block_m, num_shared=1)
    ws.sorted_pairs.fill_(POISON_INT)
    for buf in (ws.h, ws.y):
        buf.fill_(float("nan"))
    got = fused_moe(x, interleave_int4(gate_up), interleave_int4(down), weights, ids, shared=shared, workspace=ws,
                    block_m=block_m)
    assert not got.isnan().any()
    assert steps == [("interleaved_plain", 128)] * 2, steps  # gate_up and down, the shared expert riding along
    cpu = lambda t: t.cpu()  # noqa: E731
    want = moe_reference(cpu(x), cpu(dense(gate_up, x.dtype)), cpu(dense(down, x.dtype)), cpu(weights), cpu(ids),
                         type(shared)(*(cpu(t) for t in (shared.gate, shared.up, shared.down))))
    assert_close(got, want, TOL[torch.bfloat16])


def test_what_the_interleaved_order_cannot_take_is_refused(kernel_device):
    with pytest.raises(ValueError, match="group_size=32"):
        interleave_int4(quantize_int4(torch.randn(2, 4, 512), 64))
    with pytest.raises(ValueError, match="multiple of 256"):
        interleave_int4(quantize_int4(torch.randn(2, 4, 320), 32))
    empty = PackedInt4(torch.zeros(2, 4, 0, dtype=torch.int32), torch.zeros(2, 4, 0, dtype=torch.bfloat16), 32)
    with pytest.raises(ValueError, match="positive multiple of 256"):  # the kernels' K loops run at least once
        interleave_int4(empty)
    with pytest.raises(ValueError, match="positive multiple of 256"):
        PackedInt4(empty.packed, empty.scale, 32, True).check("w", (2,), 4, 0, torch.device("cpu"))
    case = CASES[0]
    x, gate_up, down, weights, ids = int4_experts(case, torch.bfloat16, kernel_device, group=32)
    gi, di = interleave_int4(gate_up), interleave_int4(down)
    with pytest.raises(ValueError, match="both be interleaved"):
        fused_moe(x, gi, down, weights, ids)
    with pytest.raises(ValueError, match="bf16 activations"):
        fused_moe(x.float(), gi, di, weights, ids)
    with pytest.raises(ValueError, match="block_m must be >= 16"):
        fused_moe(x, gi, di, weights, ids, block_m=2)
    assert not moe_int4.int4_row_kernels(x, gi, di)


def test_a_moe_layer_interleaves_its_experts_in_place_where_the_tiles_run(monkeypatch):
    """random_target (as load_target) reorders each INT4 MoE where the interleaved tiles run natively
    (never on this CPU; forced here for bf16 scales): the words change order, the layer's output
    stays that of the same MoE, and state_dict, checkpoint writing and a cast to float32 (where the
    tiles do not run) all see the checkpoint's order."""
    from ddtree.models import TargetConfig, checkpoint, int4_order
    from ddtree.models.layers import MoE
    from tests.models.checkpoints import int4_quantization_config, tiny_config

    raw = tiny_config(hidden_size=256, moe_intermediate_size=256, num_hidden_layers=2).to_dict()
    raw["quantization_config"] = int4_quantization_config(32)
    cfg = TargetConfig.from_dict(raw)
    plain = checkpoint.random_target(cfg, dtype=torch.bfloat16, seed=3)  # no sm_90 here: checkpoint order
    moe_plain = next(m for m in plain.modules() if isinstance(m, MoE))
    assert not moe_plain.int4_interleaved and not moe_plain.interleave_int4_experts()
    monkeypatch.setattr(int4_order, "interleavable", lambda gate_up, down, device: gate_up.scale.dtype == torch.bfloat16)
    target = checkpoint.random_target(cfg, dtype=torch.bfloat16, seed=3)
    moe = next(m for m in target.modules() if isinstance(m, MoE))
    assert moe.int4_interleaved and moe.experts()[0].interleaved
    assert not torch.equal(moe.w_gate_up_packed, moe_plain.w_gate_up_packed)
    x = torch.randn(5, 256, dtype=torch.bfloat16)
    with torch.no_grad():
        assert_close(moe(x), moe_plain(x), TOL[torch.bfloat16])
    for name, value in plain.state_dict().items():
        assert torch.equal(target.state_dict()[name], value), name
    written, want = checkpoint.target_tensors(target), checkpoint.target_tensors(plain)
    assert written.keys() == want.keys() and all(torch.equal(written[k], want[k]) for k in want)
    reloaded = checkpoint.random_target(cfg, dtype=torch.bfloat16, seed=4)  # interleaved, other weights
    reloaded.load_state_dict(plain.state_dict())
    moe_back = next(m for m in reloaded.modules() if isinstance(m, MoE))
    assert moe_back.int4_interleaved and torch.equal(moe_back.w_gate_up_packed, moe.w_gate_up_packed)
    as_float = target.float()  # float32 scales: the tiles do not run there, the order is undone
    assert not moe.int4_interleaved and torch.equal(moe.w_gate_up_packed, moe_plain.w_gate_up_packed)
    assert as_float is target


def test_dropped_experts_add_nothing_in_the_interleaved_order(kernel_device):
    """Expert parallelism marks other ranks' experts -1: the interleaved tiles skip them as the
    16-bit path does."""
    case = CASES[1]
    x, gate_up, down, weights, ids = int4_experts(case, torch.bfloat16, kernel_device, group=32)
    ids = ids.clone()
    ids[::2, 0] = -1
    got = fused_moe(x, interleave_int4(gate_up), interleave_int4(down), weights, ids, block_m=16)
    cpu = lambda t: t.cpu()  # noqa: E731
    kept = ids.cpu() >= 0
    want = moe_reference(cpu(x), cpu(dense(gate_up, x.dtype)), cpu(dense(down, x.dtype)),
                         cpu(weights) * kept, ids.cpu().clamp_min(0))
    assert_close(got, want, TOL[torch.bfloat16])
