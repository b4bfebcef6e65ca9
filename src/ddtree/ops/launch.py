"""What every kernel of ops/ shares: where kernels can run, the dtypes they take, programmatic
dependent launch, and the one GEMM tile (with its dot) that the few-row GEMM, the absorbed query
and the fused MoE build on.

Programmatic dependent launch (PDL, sm_90 and up). A Moonlight decode step is about 390 dependent
kernels of a few microseconds each. Without PDL each one launches only after the previous grid
has drained, then ramps up. A kernel launched with PDL starts while its predecessor still runs:
its programs wait in `wait_for_producers` (griddepcontrol.wait: the previous grid has finished
and its writes are visible), then let the next kernel launch in turn
(griddepcontrol.launch_dependents). So kernel i + 1's launch and start overlap kernel i, and at
most two grids are resident at once; CUDA graphs keep the dependency as a programmatic edge. The
rule for a kernel launched with these flags: `wait_for_producers(PDL)` comes before any global
memory access. A PDL kernel that follows one without PDL (cuBLAS, PyTorch's) waits for it all the
same, and a kernel without PDL that follows a PDL kernel waits for it as usual. Whether a launch
uses it is the caller's KernelPolicy's `pdl` (ops/policy.py).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton import knobs
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

DTYPES = (torch.bfloat16, torch.float16, torch.float32)  # what the kernels of ops/ take
TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


def require_kernel_device(device: torch.device, what: str) -> None:
    """Raise a clear error when `what` (a Triton path) is asked to run where it cannot."""
    if device.type == "cuda":
        return
    if not knobs.runtime.interpret:
        raise ValueError(f"{what} needs CUDA tensors (got {device}) or TRITON_INTERPRET=1 set before import")


@functools.lru_cache(maxsize=None)
def multiprocessors(device: torch.device) -> int:
    """SMs of a CUDA device; 8 elsewhere (the interpreter: any small number exercises the paths
    that split work across programs)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 8


@functools.lru_cache(maxsize=None)
def _sm90_or_later(device: torch.device) -> bool:
    return torch.cuda.get_device_capability(device)[0] >= 9


def compiled_for_sm90(device: torch.device) -> bool:
    """Whether kernels launched on `device` are compiled for a GPU of compute capability 9.0 or
    more (not interpreted): what programmatic dependent launch and sm_90 PTX need."""
    return device.type == "cuda" and not knobs.runtime.interpret and _sm90_or_later(device)


def launch_flags(device: torch.device, pdl: bool = True) -> dict:
    """Keyword arguments for a kernel launch on `device`: the kernel's PDL constexpr and Triton's
    launch_pdl option, both True when `pdl` is asked for and compiled_for_sm90(device)."""
    on = pdl and compiled_for_sm90(device)
    return dict(PDL=on, launch_pdl=on)


@triton.jit
def wait_for_producers(PDL: tl.constexpr):
    """The first statement of a PDL kernel: wait for the previous grid, then release the next."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


def dot_flags(dtype: torch.dtype) -> dict:
    """The constexprs of `dot` for inputs of `dtype`: DOT_F32 (bf16 under the interpreter) and
    PRECISION ("ieee" for float32; "tf32" is ignored for 16-bit inputs)."""
    return dict(DOT_F32=dtype == torch.bfloat16 and knobs.runtime.interpret,
                PRECISION="ieee" if dtype == torch.float32 else "tf32")


@triton.jit
def dot(a, b, acc, DOT_F32: tl.constexpr, PRECISION: tl.constexpr):
    # DOT_F32: Triton 3.6's interpreter multiplies bf16 bit patterns as integers, so CPU runs upcast
    # bf16 (exactly) first. PRECISION "ieee" keeps float32 models off TF32, as torch.matmul is.
    if DOT_F32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision=PRECISION)
    return tl.dot(a, b, acc, input_precision=PRECISION)


@triton.jit
def matmul_tile(a_ptrs, w_ptrs, a_step, w_step, row_ok, col_ok, depth,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                DOT_F32: tl.constexpr, PRECISION: tl.constexpr):
    """a @ W for one [BLOCK_M, BLOCK_N] tile over `depth`, float32; pointers at k = 0, each K step
    advancing them by a_step and w_step."""
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, depth, BLOCK_K):
        k_ok = offs_k < depth - k0
        a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        acc = dot(a, tl.load(w_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0), acc, DOT_F32, PRECISION)
        a_ptrs += a_step
        w_ptrs += w_step
    return acc
