"""fused_moe's INT4 GEMMs in the interleaved order, compiled for sm_90 here (no GPU) at any tile:
registers per thread, shared memory per CTA, how many CTAs and warps an SM can hold by each, the
tensor-core instructions and the whole kernel's SASS length (tests/ops/fused_moe_compile.py's
report). What a tile costs in occupancy before a device times it (docs/notes/int4.md).

    PYTHONPATH=src python dev/int4_tile_compile.py --tiles 64x64x64:4:2 64x128x64:8:2 64x64x64:4:2:128
    (BLOCK_M x BLOCK_N x BLOCK_K : warps : stages [: K step, 256 or 128 columns]; TRITON_INTERPRET unset)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "src"))

from ddtree.ops import moe_kernels  # noqa: E402
from tests.ops.fused_moe_compile import compile_report  # noqa: E402

REGISTERS_PER_SM = 65536
SHARED_PER_SM = 233472  # 228 KB, of which each CTA's 1 KB is reserved


def occupancy(registers: int, warps: int, shared: int) -> tuple[int, int]:
    """(CTAs an SM holds by its registers, by its shared memory): registers are given out per warp
    in units of 256 (8 a thread)."""
    by_registers = REGISTERS_PER_SM // (-(-registers // 8) * 8 * 32 * warps)
    by_shared = SHARED_PER_SM // (shared + 1024)
    return by_registers, by_shared


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiles", nargs="+", default=["64x64x64:4:2", "64x128x64:8:2"])
    args = parser.parse_args()
    index = dict(sorted_pairs_ptr="*i32", block_expert_ptr="*i32")
    kernels = {
        "gate_up": (moe_kernels.gate_up_kernel, dict(x_ptr="*bf16", w_ptr="*i32", h_ptr="*bf16", shared_gate_ptr="*bf16",
                                                     shared_up_ptr="*bf16", scale_ptr="*bf16", **index)),
        "down": (moe_kernels.down_kernel, dict(h_ptr="*bf16", w_ptr="*i32", weights_ptr="*fp32", y_ptr="*fp32",
                                               shared_down_ptr="*bf16", scale_ptr="*bf16", **index)),
    }
    print("| kernel | tile | warps | stages | K step | registers | shared KB | CTAs an SM: registers / shared | warps an SM "
          "| MMA | SASS | serialized wgmma |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for spec in args.tiles:
        shape, warps, stages, *step = spec.split(":")
        step = int(step[0]) if step else 256
        block_m, block_n, block_k = (int(v) for v in shape.split("x"))
        flags = dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, DOT_F32=False, PRECISION="tf32", W4=True,
                     GROUP=32, EVEN_K=True, UNPACK="interleaved", DIRECT=False, STEP=step)
        for name, (kernel, pointers) in kernels.items():
            r = compile_report(kernel, pointers, flags, num_warps=int(warps), num_stages=int(stages))
            by_registers, by_shared = occupancy(r["registers"], int(warps), r["shared"])
            ctas = min(by_registers, by_shared)
            print(f"| {name} | {shape} | {warps} | {stages} | {step} | {r['registers']} (spills {r['spill_bytes']} B) | "
                  f"{r['shared'] / 1024:.0f} | {by_registers} / {by_shared} | {ctas * int(warps)} | {r['mma']} | "
                  f"{r['instructions']} | {r['serialized_wgmma']} |", flush=True)


if __name__ == "__main__":
    main()
