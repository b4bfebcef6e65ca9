"""The kernel policy: one object, chosen when a model is built or loaded, reaches every layer that
has a kernel; its choices follow the device, autograd and its limits; bad values are refused."""

import pytest
import torch

from ddtree.models import random_target
from ddtree.models.layers import RMSNorm, Router
from ddtree.models.target import MLA, MoE
from ddtree.ops import KERNELS, REFERENCE, KernelPolicy, apply_policy

from ..models.test_fused_target import tiny


def test_one_policy_reaches_every_layer_with_a_kernel():
    policy = KernelPolicy(pdl=False, moe_fused_max_tokens=7)
    model = random_target(tiny(20, False), dtype=torch.float32, policy=policy)
    holders = [m for m in model.modules() if isinstance(m, (RMSNorm, MLA, Router, MoE))]
    assert {type(m) for m in holders} == {RMSNorm, MLA, Router, MoE}
    assert all(m.policy is policy for m in holders)
    assert apply_policy(model, REFERENCE) == len(holders) and all(m.policy is REFERENCE for m in holders)
    with pytest.raises(TypeError, match="policy must be a KernelPolicy"):
        apply_policy(model, "kernels")


class Tensor:  # stands for a tensor where only the device and autograd matter
    def __init__(self, cuda: bool, grad: bool = False):
        self.device, self.requires_grad = torch.device("cuda" if cuda else "cpu"), grad


def test_the_choices():
    auto = KernelPolicy()
    assert auto.kernel("x", Tensor(True)) and not auto.kernel("x", Tensor(False))
    with torch.enable_grad():
        assert not auto.kernel("x", Tensor(True), Tensor(True, grad=True))  # autograd keeps PyTorch
        with pytest.raises(RuntimeError, match="x: the kernel policy forces kernels, but autograd needs"):
            KERNELS.kernel("x", Tensor(False, grad=True))
    with torch.no_grad():  # no gradient is recorded: the weights' requires_grad does not matter
        assert auto.kernel("x", Tensor(True), Tensor(True, grad=True))
    assert KERNELS.kernel("x", Tensor(False)) and not REFERENCE.kernel("x", Tensor(True))
    cuda = Tensor(True)
    limit = auto.moe_fused_max_tokens
    assert auto.moe_fused(limit, 8 * limit, torch.bfloat16, cuda)
    assert not auto.moe_fused(limit + 1, 8, torch.bfloat16, cuda)  # many rows: the grouped GEMMs
    assert not auto.moe_fused(1, 8, torch.float64, cuda)  # no kernel for float64
    assert not auto.moe_fused(8, 9000, torch.bfloat16, cuda)  # past the alignment's pairs
    assert KERNELS.moe_fused(10**6, 8, torch.bfloat16, Tensor(False))  # forced: no limit applies
    # auto_devices: "auto" may take the (interpreted) kernels on the CPU too, within the same limits
    cpu_too = KernelPolicy(auto_devices=("cuda", "cpu"))
    assert cpu_too.kernel("x", Tensor(False)) and cpu_too.kernel("x", Tensor(True))
    assert not KernelPolicy(auto_devices=("cpu",)).kernel("x", Tensor(True))
    assert not KernelPolicy(auto_devices=()).kernel("x", Tensor(True))
    assert cpu_too.moe_fused(limit, 8, torch.bfloat16, Tensor(False))
    assert not cpu_too.moe_fused(limit + 1, 8, torch.bfloat16, Tensor(False))
    with torch.enable_grad():
        assert not cpu_too.kernel("x", Tensor(False, grad=True))


@pytest.mark.parametrize("fields,match", [
    (dict(paths="fast"), "kernel paths must be one of"),
    (dict(gemm_max_rows=17), r"gemm_max_rows must be in \[0, 16\]"),
    (dict(moe_fused_max_tokens=-1), "token limits must be >= 0"),
    (dict(auto_devices=("cuda", "mps")), "auto_devices must be a tuple of"),
    (dict(auto_devices="cpu"), "auto_devices must be a tuple of"),
])
def test_bad_policies_are_refused(fields, match):
    with pytest.raises(ValueError, match=match):
        KernelPolicy(**fields)
