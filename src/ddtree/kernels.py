"""Where the Triton kernels can run: on CUDA tensors, or anywhere under TRITON_INTERPRET=1."""

from __future__ import annotations

import torch


def require_kernel_device(device: torch.device, what: str) -> None:
    """Raise a clear error when `what` (a Triton path) is asked to run where it cannot."""
    if device.type == "cuda":
        return
    from triton import knobs  # triton is a Linux-only dependency: import it only when asked

    if not knobs.runtime.interpret:
        raise ValueError(f"{what} needs CUDA tensors (got {device}) or TRITON_INTERPRET=1 set before import")
