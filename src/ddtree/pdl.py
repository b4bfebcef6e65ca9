"""Programmatic dependent launch (PDL) for the decode step's small Triton kernels (sm_90 and up).

A Moonlight decode step is about 390 dependent kernels of a few microseconds each. Without PDL
each one launches only after the previous grid has drained, then ramps up. A kernel launched with
PDL starts while its predecessor still runs: its programs wait in `wait_for_producers`
(griddepcontrol.wait: the previous grid has finished and its writes are visible), then let the
next kernel launch in turn (griddepcontrol.launch_dependents). So kernel i + 1's launch and start
overlap kernel i, and at most two grids are resident at once. CUDA graphs keep the dependency as a
programmatic edge.

The rule for a kernel launched with these flags: `wait_for_producers(PDL)` comes before any global
memory access. A PDL kernel that follows one without PDL (cuBLAS, PyTorch's) waits for it all the
same, and a kernel without PDL that follows a PDL kernel waits for it as usual. Kernels that use
it: the norm, the few-row GEMMs, absorbed_query, the router, the fused MoE's, MLA's rotary and
cache-entry kernels, the Gluon attention and its split merge.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl
from triton import knobs
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

# The switch: on unless DDTREE_PDL=0 is set (for debugging a kernel in isolation; the results are the
# same bits either way). dev/round_variants.py times the decode round both ways.
ENABLED = os.environ.get("DDTREE_PDL", "1") != "0"


@functools.lru_cache(maxsize=None)
def _capable(device: torch.device) -> bool:
    return torch.cuda.get_device_capability(device)[0] >= 9


def launch_flags(device: torch.device) -> dict:
    """Keyword arguments for a kernel launch on `device`: the kernel's PDL constexpr and Triton's
    launch_pdl option, both True on a CUDA device of compute capability 9.0 or more (not under the
    interpreter) while ENABLED is set."""
    on = ENABLED and device.type == "cuda" and not knobs.runtime.interpret and _capable(device)
    return dict(PDL=on, launch_pdl=on)


@triton.jit
def wait_for_producers(PDL: tl.constexpr):
    """The first statement of a PDL kernel: wait for the previous grid, then release the next."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()

