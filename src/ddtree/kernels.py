"""Where the Triton kernels can run: on CUDA tensors, or anywhere under TRITON_INTERPRET=1."""

from __future__ import annotations

import functools

import torch


def require_kernel_device(device: torch.device, what: str) -> None:
    """Raise a clear error when `what` (a Triton path) is asked to run where it cannot."""
    if device.type == "cuda":
        return
    from triton import knobs  # triton is a Linux-only dependency: import it only when asked

    if not knobs.runtime.interpret:
        raise ValueError(f"{what} needs CUDA tensors (got {device}) or TRITON_INTERPRET=1 set before import")


def use_kernel(flag: bool | None, what: str, *tensors: torch.Tensor) -> bool:
    """Whether a module takes its Triton path, from its switch `flag`: None (automatic) on CUDA
    tensors when autograd needs nothing from this call; True forces it (on the CPU: the
    interpreter; an error when autograd would need a backward); False keeps the PyTorch path."""
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
    if flag is None:
        return tensors[0].is_cuda and not needs_grad
    if flag and needs_grad:
        raise RuntimeError(f"{what} is True but autograd needs this forward: the kernel has no backward")
    return flag


@functools.lru_cache(maxsize=None)
def multiprocessors(device: torch.device) -> int:
    """SMs of a CUDA device; 8 elsewhere (the interpreter: any small number exercises the paths
    that split work across programs)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 8
