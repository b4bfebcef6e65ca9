"""Compile the Gluon Hopper kernel for sm_90 without a GPU (Triton ships ptxas and cuobjdump) and
report what the hardware would get: shared memory, registers, spills and the tensor-core mix."""

from __future__ import annotations

import re
from collections import Counter

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import CUDABackend
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import GluonASTSource
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
from triton.runtime.jit import native_specialize_impl

from ddtree.attention import tree_verify_hopper

from ..sm90_assembly import assemble, waits_before_memory



def compile_report(page_rows: int = 64, epilogue: int = 2) -> dict:
    """{"shared": bytes, "registers": n, "spill_bytes": n, "hgmma": Counter of SASS HGMMA shapes,
    "ttgir": text} for one configuration of tree_verify_hopper_kernel, compiled for sm_90a."""
    target = GPUTarget("cuda", 90, 32)
    backend = CUDABackend(target)
    layout = gl.NVMMASharedLayout(128, 16)
    rows = torch.zeros(4096, 576, dtype=torch.bfloat16)  # stands in for q and the cache
    out = torch.zeros(4096, 512, dtype=torch.bfloat16)

    def descriptors(box_rows):
        return (TensorDescriptor(rows, [4096, 512], [576, 1], [box_rows, 512], layout),
                TensorDescriptor(rows[:, 512:], [4096, 64], [576, 1], [box_rows, 64], layout))

    (kn, kr), (qn, qr) = descriptors(page_rows), descriptors(64)
    tensors = dict(qn_desc=qn, qr_desc=qr, kn_desc=kn, kr_desc=kr,
                   out_desc=TensorDescriptor(out, [4096, 512], [512, 1], [64, 512], layout),
                   block_table_ptr=torch.zeros(1, dtype=torch.int32), prefix_ptr=torch.zeros(1, dtype=torch.int32),
                   num_rows_ptr=torch.zeros(1, dtype=torch.int32), vis_ptr=torch.zeros(1, dtype=torch.int64),
                   out_ptr=out, lse_ptr=torch.zeros(1))
    constants = dict(D_V=512, D_ROPE=64, BLOCK_M=64, BLOCK_N=64, PAGE_ROWS=page_rows, EPILOGUE=epilogue, PDL=True)
    fn = tree_verify_hopper.tree_verify_hopper_kernel
    signature, constexprs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in constants:
            signature[name] = "constexpr"
            constexprs[(i,)] = constants[name]
        elif name in tensors:
            signature[name] = native_specialize_impl(backend, tensors[name], False, True, True)[0]
        else:
            signature[name] = "fp32" if name == "qk_scale" else "i32"
    compiled = triton.compile(GluonASTSource(fn, signature, constexprs), target=target, options={"num_warps": 8})
    asm = assemble(compiled)
    return {
        "shared": compiled.metadata.shared,
        "registers": asm["registers"],
        "spill_bytes": asm["spill_bytes"],
        "serialized_wgmma": asm["serialized_wgmma"],
        "hgmma": Counter(re.findall(r"HGMMA\.(\d+x\d+x\d+)", asm["sass"])),
        "ttgir": compiled.asm["ttgir"],
        "pdl_waits": compiled.asm["ptx"].count("griddepcontrol.wait"),
        "waits_first": waits_before_memory(compiled.asm["ptx"]),
    }
