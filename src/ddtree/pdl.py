"""Programmatic dependent launch (PDL) for the decode step's small Triton kernels (sm_90 and up).

A Moonlight decode step is about 440 dependent kernels of a few microseconds each. Without PDL
each one launches only after the previous grid has drained, then ramps up. A kernel launched with
PDL starts while its predecessor still runs: its programs wait in `wait_for_producers`
(griddepcontrol.wait: the previous grid has finished and its writes are visible), then let the
next kernel launch in turn (griddepcontrol.launch_dependents). So kernel i + 1's launch and start
overlap kernel i, and at most two grids are resident at once. CUDA graphs keep the dependency as a
programmatic edge.

The rule for a kernel launched with these flags: `wait_for_producers(PDL)` comes before any global
memory access, except (1) reads of weights, which no kernel writes, and (2) reads of what the kernel
before the previous one wrote: a PDL kernel starts only after the previous kernel's programs have
all passed their own wait, so the one before that has finished. A kernel that follows one without
PDL (cuBLAS, PyTorch's, the Gluon attention) is unaffected, and one without PDL that follows a PDL
kernel waits for it as usual.

While it waits, a kernel can prefetch its weights into L2 (`prefetch_runs`): the weight read of a
few-row GEMM then overlaps the kernel before it.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton import knobs
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

ENABLED = True  # the switch; dev/round_variants.py times the decode round both ways
PREFETCH = False  # with ENABLED: GEMM kernels prefetch their weights into L2 while they wait (slower so far)
LINE_BYTES = 128  # an L2 line


@functools.lru_cache(maxsize=None)
def _capable(device: torch.device) -> bool:
    return torch.cuda.get_device_capability(device)[0] >= 9


def launch_flags(device: torch.device) -> dict:
    """Keyword arguments for a kernel launch on `device`: the kernel's PDL constexpr and Triton's
    launch_pdl option, both True on a CUDA device of compute capability 9.0 or more (not under the
    interpreter) while ENABLED is set."""
    on = ENABLED and device.type == "cuda" and not knobs.runtime.interpret and _capable(device)
    return dict(PDL=on, launch_pdl=on)


def prefetch_mode(stride_k: int, stride_n: int) -> int:
    """A GEMM kernel's PREFETCH constexpr for a weight of strides (K, N): 1 where K is contiguous
    (nn.Linear's [N, K] seen as [K, N]), 2 where N is, 0 (none) otherwise or when PREFETCH is off."""
    if not PREFETCH:
        return 0
    return 1 if stride_k == 1 else 2 if stride_n == 1 else 0


@triton.jit
def wait_for_producers(PDL: tl.constexpr):
    """The first statement of a PDL kernel: wait for the previous grid, then release the next."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


@triton.jit
def prefetch_runs(base, run_stride, runs, run_len, LINE: tl.constexpr, RUN_BLOCK: tl.constexpr,
                  LINE_BLOCK: tl.constexpr):
    """Prefetch into L2 the 128-byte lines of `runs` runs of `run_len` contiguous elements, run r at
    base + r * run_stride; LINE elements make a line. No other effect (no data is returned, nothing
    is written), so it may run before wait_for_producers. CUDA only: the interpreter has no PTX."""
    offs_r = tl.arange(0, RUN_BLOCK)
    offs_c = tl.arange(0, LINE_BLOCK) * LINE
    for r0 in range(0, runs, RUN_BLOCK):
        for c0 in range(0, run_len, LINE_BLOCK * LINE):
            r = r0 + offs_r
            c = c0 + offs_c
            ok = (r < runs)[:, None] & (c < run_len)[None, :]
            offset = tl.where(ok, r.to(tl.int64)[:, None] * run_stride + c[None, :], 0)
            tl.inline_asm_elementwise("prefetch.global.L2 [$1]; // dummy $0", "=r,l", [base + offset],
                                      dtype=tl.int32, is_pure=False, pack=1)
