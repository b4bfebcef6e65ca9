"""Two nn.Linear that read the same input, stored in one buffer so a forward reads it with one GEMM.

Parameter names, shapes and state_dict stay as they were: each weight is a view of the joint
buffer. A later .to() or reassignment splits them again, and the caller falls back to two GEMMs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def join(first: nn.Linear, second: nn.Linear) -> None:
    """Move both weights ([out_1, in], [out_2, in]) into one [out_1 + out_2, in] buffer, values kept."""
    joint = torch.cat([first.weight.detach(), second.weight.detach()])
    first.weight = nn.Parameter(joint[: first.weight.shape[0]], requires_grad=first.weight.requires_grad)
    second.weight = nn.Parameter(joint[first.weight.shape[0] :], requires_grad=second.weight.requires_grad)


def joint_weight(first: nn.Linear, second: nn.Linear) -> torch.Tensor | None:
    """[out_1 + out_2, in]: both weights as one view when they are adjacent in memory (join) and no
    gradient is wanted (the view would feed only one of them); else None."""
    a, b = first.weight, second.weight
    if torch.is_grad_enabled() and (a.requires_grad or b.requires_grad):
        return None
    if a.dtype != b.dtype or a.device != b.device or not (a.is_contiguous() and b.is_contiguous()):
        return None
    if b.data_ptr() != a.data_ptr() + a.numel() * a.element_size():
        return None
    # Adjacent is not enough: two separate allocations can sit back to back (the CUDA caching
    # allocator did so on the H200 after a .to()); the view must stay inside one storage.
    if a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return None
    return a.as_strided((a.shape[0] + b.shape[0], a.shape[1]), (a.shape[1], 1))


def both(first: nn.Linear, second: nn.Linear, x: torch.Tensor, linear=F.linear) -> tuple[torch.Tensor, torch.Tensor]:
    """(first(x), second(x)) for x [..., in]: one GEMM over the joint view when there is one.
    `linear(x, weight)` computes it (skinny.linear on a decode step's kernel path; it reads the
    weights only, so it is for bias-free projections)."""
    joint = joint_weight(first, second)
    if joint is None:  # the modules themselves, unless another GEMM was asked for
        if linear is F.linear:
            return first(x), second(x)
        return linear(x, first.weight), linear(x, second.weight)
    return linear(x, joint).split([first.weight.shape[0], second.weight.shape[0]], dim=-1)
