"""Compile the Gluon tree-verify kernel for sm_90 on a machine without a GPU: catches compile
errors and reports shared memory, registers (ptxas -v) and the wgmma mix in the SASS."""

import re
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import CUDABackend
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import GluonASTSource
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
from triton.runtime.jit import native_specialize_impl

from ddtree.attention import tree_verify_hopper as k

target = GPUTarget("cuda", 90, 32)
backend = CUDABackend(target)
page_rows = int(sys.argv[1]) if len(sys.argv) > 1 else 64
kv = torch.zeros(64 * 64, 576, dtype=torch.bfloat16)
layout = gl.NVMMASharedLayout(128, 16)
kn = TensorDescriptor(kv, [kv.shape[0], 512], [576, 1], [page_rows, 512], layout)
kr = TensorDescriptor(kv[:, 512:], [kv.shape[0], 64], [576, 1], [page_rows, 64], layout)
qn = TensorDescriptor(kv, [kv.shape[0], 512], [576, 1], [64, 512], layout)
qr = TensorDescriptor(kv[:, 512:], [kv.shape[0], 64], [576, 1], [64, 64], layout)
out = torch.zeros(4096, 512, dtype=torch.bfloat16)
od = TensorDescriptor(out, [4096, 512], [512, 1], [64, 512], layout)
fn = k._tree_verify_hopper_kernel
names = list(fn.arg_names)
args = dict(qn_desc=qn, qr_desc=qr, out_desc=od, kn_desc=kn, kr_desc=kr, block_table_ptr=torch.zeros(1, dtype=torch.int32),
            prefix_ptr=torch.zeros(1, dtype=torch.int32), num_nodes_ptr=torch.zeros(1, dtype=torch.int32),
            vis_ptr=torch.zeros(1, dtype=torch.int64), out_ptr=kv, lse_ptr=torch.zeros(1))
consts = dict(D_V=512, D_ROPE=64, BLOCK_M=64, BLOCK_N=64, PAGE_ROWS=page_rows, EPILOGUE=2)
consts.update(__import__("json").loads(sys.argv[2]) if len(sys.argv) > 2 else {})
signature, constexprs = {}, {}
for name in names:
    if name in consts or (name.isupper() and fn.params[names.index(name)].default is not None):
        consts.setdefault(name, fn.params[names.index(name)].default)
        signature[name] = "constexpr"
        constexprs[(names.index(name),)] = consts[name]
    elif name in args:
        signature[name] = native_specialize_impl(backend, args[name], False, True, True)[0]
    elif name == "qk_scale":
        signature[name] = "fp32"
    else:
        signature[name] = "i32"
src = GluonASTSource(fn, signature, constexprs)
compiled = triton.compile(src, target=target, options={"num_warps": 8})
print("shared bytes", compiled.metadata.shared)
with tempfile.TemporaryDirectory() as d:
    ptx = Path(d) / "k.ptx"
    ptx.write_text(compiled.asm["ptx"])
    ptxas = Path(triton.__file__).parent / "backends/nvidia/bin/ptxas"
    info = subprocess.run([str(ptxas), "-v", "-arch=sm_90a", str(ptx), "-o", str(Path(d) / "k.cubin")],
                          capture_output=True, text=True)
    print("\n".join(line for line in info.stderr.splitlines() if "registers" in line or "spill" in line))
    (Path(d) / "k.cubin").write_bytes(compiled.asm["cubin"])
    cuobjdump = Path(triton.__file__).parent / "backends/nvidia/bin/cuobjdump"
    sass = subprocess.run([str(cuobjdump), "-sass", str(Path(d) / "k.cubin")], capture_output=True, text=True).stdout
print({m: n for m, n in zip(*__import__("numpy").unique(re.findall(r"HGMMA\.\S+", sass), return_counts=True))})
Path("/tmp/hopper.ttgir").write_text(compiled.asm["ttgir"])
Path("/tmp/hopper.sass").write_text(sass)
