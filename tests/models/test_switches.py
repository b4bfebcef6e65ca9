"""set_kernel_paths sets every switched module of a model, and refuses an unknown choice."""

import pytest
import torch

from ddtree.models import random_target
from ddtree.models.moe import MoE, Router
from ddtree.models.norm import RMSNorm
from ddtree.models.switches import set_kernel_paths
from ddtree.models.target import MLA

from .test_fused_target import tiny


def test_set_kernel_paths_reaches_every_switched_module():
    model = random_target(tiny(20, False), dtype=torch.float32)
    switched = [m for m in model.modules() if isinstance(m, (RMSNorm, MLA, Router, MoE))]
    assert {type(m) for m in switched} == {RMSNorm, MLA, Router, MoE}
    for choice, flag in (("reference", False), ("kernels", True), ("auto", None)):
        assert set_kernel_paths(model, choice) == len(switched)
        assert all(m.fused is flag for m in switched), choice
    with pytest.raises(ValueError, match="kernel paths must be one of"):
        set_kernel_paths(model, "fast")
