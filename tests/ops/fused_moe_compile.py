"""Compile the fused MoE kernels for sm_90 without a GPU (Triton ships ptxas and cuobjdump) and
report what the hardware would get: shared memory, registers, spills, tensor-core instructions and
pipelined (cp.async) loads. Run without TRITON_INTERPRET."""

from __future__ import annotations

import re

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from ddtree.ops import moe as fused_moe
from ddtree.ops import moe_align, moe_int4, moe_int4_rows
from ddtree.ops import moe_kernels as fused_moe_kernels

from ..sm90_assembly import assemble, longest_loop, waits_before_memory

# Integer arguments that a launch at Kimi K2 / Moonlight shapes does not see as multiples of 16;
# Triton specializes every other pointer and integer there as 16-divisible, and so does this.
NOT_DIVISIBLE = {"num_pairs", "num_tokens", "top_k", "num_experts", "num_blocks", "routed_blocks", "token_blocks"}


def compile_report(fn, pointers: dict[str, str], constants: dict, num_warps: int, num_stages: int = 1,
                   not_divisible: tuple[str, ...] = ()) -> dict:
    """{"shared": bytes, "registers": n, "spill_bytes": n, "mma": n SASS HMMA/HGMMA, "serialized_wgmma":
    ptxas made each wgmma wait for the last (sm90_assembly.assemble), "async_copies": n,
    "approx_divides": n PTX div.full / div.approx, "pdl_waits": n griddepcontrol.wait,
    "waits_first": the first wait comes before any global memory access, "word_vector_copies": n,
    "vector_loads": n} for `fn` compiled for sm_90a; pointers maps pointer and non-i32 arguments to
    Triton types ("*bf16", "fp32"); not_divisible: more arguments not specialized as 16-divisible.
    A kernel with a PDL constexpr is compiled with it on, as an H200 launches it (ops/launch.py)."""
    if "PDL" in fn.arg_names:
        constants = {"PDL": True, **constants}
    signature, constexprs, attrs = {}, {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in constants:
            signature[name] = "constexpr"
            constexprs[(i,)] = constants[name]
            continue
        signature[name] = pointers.get(name, "i32")
        if name not in NOT_DIVISIBLE and name not in not_divisible:
            attrs[(i,)] = [["tt.divisibility", 16]]
    compiled = triton.compile(ASTSource(fn, signature, constexprs, attrs), target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": num_warps, "num_stages": num_stages})
    asm = assemble(compiled)
    loop = [text.split()[1] if text.startswith("@") else text.split()[0] for text in longest_loop(asm["sass"])]
    return {
        "shared": compiled.metadata.shared,
        "registers": asm["registers"],
        "spill_bytes": asm["spill_bytes"],
        "mma": len(re.findall(r"\bHG?MMA\.", asm["sass"])),
        "serialized_wgmma": asm["serialized_wgmma"],
        "async_copies": compiled.asm["ttgir"].count("ttg.async_copy_global_to_local"),
        # INT4 words copied 16 bytes at a time (4 adjacent int32 per copy)
        "word_vector_copies": len(re.findall(r"async_copy_global_to_local.*\{contiguity = (?:4|8) : i32\} : "
                                             r"tensor<[0-9x]+!tt\.ptr<i32>", compiled.asm["ttgir"])),
        # 16-byte loads straight into registers (the row kernels' words and activations)
        "vector_loads": len(re.findall(r"\bld\.global(?:\.nc)?\.v4\.b32\b", compiled.asm["ptx"])),
        # 2-D loads the pipeliner left in their K step (not copied ahead: every step waits on memory)
        "blocking_tile_loads": len(re.findall(r"= tt\.load [^\n]*: tensor<\d+x\d+x!tt\.ptr", compiled.asm["ttgir"])),
        # register tensors stored to shared memory (an unpacked weight tile on its way to the MMA)
        "stored_register_tiles": compiled.asm["ttgir"].count("ttg.local_alloc %"),
        # values its main (K) loop moves between threads or stores to shared memory itself, as a
        # layout conversion would (SASS; asynchronous copies are LDGSTS, not counted)
        "loop_shuffles": sum(op.startswith("SHFL") for op in loop),
        "loop_shared_stores": sum(op.startswith("STS") for op in loop),
        "approx_divides": len(re.findall(r"\bdiv\.(full|approx)\.", compiled.asm["ptx"])),  # fast, not IEEE
        "instructions": len(re.findall(r"^\s+/\*[0-9a-f]{4,}\*/", asm["sass"], re.MULTILINE)),  # SASS, per thread
        "pdl_waits": compiled.asm["ptx"].count("griddepcontrol.wait"),
        "waits_first": waits_before_memory(compiled.asm["ptx"]),
    }


def all_reports() -> dict[str, dict]:
    """The four kernels at their defaults, bf16 (the GEMMs also in direct mode, without the
    alignment, and with INT4 experts in groups of 32, unpacked by word, in pairs and in the
    interleaved order; the INT4 row kernels); the alignment at 64 tokens x 8 of 384 experts and at
    4096 pairs over 64 experts."""
    dtype = "*bf16"
    tiles = dict(BLOCK_M=fused_moe.BLOCK_M, BLOCK_N=fused_moe.BLOCK_N, BLOCK_K=fused_moe.BLOCK_K,
                 DOT_F32=False, PRECISION="tf32", W4=False, GROUP=32, EVEN_K=False, UNPACK="word", STEP=256)
    index = dict(sorted_pairs_ptr="*i32", block_expert_ptr="*i32")
    gemm = dict(num_warps=fused_moe.NUM_WARPS, num_stages=fused_moe.NUM_STAGES)
    gate_up_pointers = dict(x_ptr=dtype, w_ptr=dtype, h_ptr=dtype, shared_gate_ptr=dtype, shared_up_ptr=dtype,
                            scale_ptr=dtype, **index)
    down_pointers = dict(h_ptr=dtype, w_ptr=dtype, weights_ptr="*fp32", y_ptr="*fp32", shared_down_ptr=dtype,
                         scale_ptr=dtype, **index)
    direct = dict(tiles, DIRECT=True)
    tiles = dict(tiles, DIRECT=False)
    int4 = dict(tiles, W4=True, EVEN_K=True)  # Kimi K2.6's hidden and inter are multiples of BLOCK_K
    # as fused_moe launches them: pairs with the scales two to a word; the interleaved order's tiles
    pairs = dict(int4, UNPACK="pairs", SCALE_PAIRS=True)
    inter_n, inter_k = moe_int4.INT4_INTERLEAVED_TILES
    interleaved = dict(int4, UNPACK="interleaved", BLOCK_N=inter_n, BLOCK_K=inter_k)
    block_n, block_k = moe_int4.INT4_ROWS_TILES
    rows = dict(BLOCK_N=block_n, BLOCK_K=block_k, GROUP=32, EVEN_K=True)
    rows_launch = dict(num_warps=moe_int4.INT4_ROWS_WARPS, num_stages=fused_moe.NUM_STAGES)
    index_i64 = dict(index, block_expert_ptr="*i64")
    return {
        "align": compile_report(moe_align._align_kernel, dict(ids_ptr="*i64", **index),
                                dict(P_PAD=512, E_PAD=512, BLOCK_M=fused_moe.BLOCK_M, CHUNK=64),
                                num_warps=moe_align.align_warps(512)),
        # a verify of 544 rows on Moonlight's 64 experts (top 6): at 4 warps and as launched
        "align_wide_4_warps": compile_report(moe_align._align_kernel, dict(ids_ptr="*i64", **index),
                                             dict(P_PAD=4096, E_PAD=64, BLOCK_M=fused_moe.BLOCK_M, CHUNK=64), num_warps=4),
        "align_wide": compile_report(moe_align._align_kernel, dict(ids_ptr="*i64", **index),
                                     dict(P_PAD=4096, E_PAD=64, BLOCK_M=fused_moe.BLOCK_M, CHUNK=64),
                                     num_warps=moe_align.align_warps(4096)),
        "gate_up": compile_report(fused_moe_kernels.gate_up_kernel, gate_up_pointers, tiles, **gemm),
        "down": compile_report(fused_moe_kernels.down_kernel, down_pointers, tiles, **gemm),
        "gate_up_direct": compile_report(fused_moe_kernels.gate_up_kernel, dict(gate_up_pointers, block_expert_ptr="*i64"),
                                         direct, **gemm),
        "down_direct": compile_report(fused_moe_kernels.down_kernel, dict(down_pointers, block_expert_ptr="*i64"),
                                      direct, **gemm),
        "gate_up_int4": compile_report(fused_moe_kernels.gate_up_kernel, dict(gate_up_pointers, w_ptr="*i32"), int4,
                                       **gemm),
        "down_int4": compile_report(fused_moe_kernels.down_kernel, dict(down_pointers, w_ptr="*i32"), int4, **gemm),
        **{f"{name}_int4_{unpack}": compile_report(kernel, dict(pointers, w_ptr="*i32"), flags, **gemm)
           for unpack, flags in (("pairs", pairs), ("interleaved", interleaved))
           for name, kernel, pointers in (("gate_up", fused_moe_kernels.gate_up_kernel, gate_up_pointers),
                                          ("down", fused_moe_kernels.down_kernel, down_pointers))},
        # the interleaved tiles at a tree verify's many rows per expert, as launched there
        # (and at 128-column K steps: moe_int4.INT4_INTERLEAVED_STEP)
        **{f"{name}_int4_interleaved_many{suffix}": compile_report(
            kernel, dict(pointers, w_ptr="*i32"), dict(interleaved, BLOCK_M=64, STEP=step),
            num_warps=fused_moe.NUM_WARPS, num_stages=moe_int4.INT4_INTERLEAVED_STAGES_MANY)
           for suffix, step in (("", 256), ("_step128", 128))
           for name, kernel, pointers in (("gate_up", fused_moe_kernels.gate_up_kernel, gate_up_pointers),
                                          ("down", fused_moe_kernels.down_kernel, down_pointers))},
        # the INT4 row kernels at their defaults: a decode token (one pair per program) and blocks of two
        "gate_up_rows": compile_report(moe_int4_rows.gate_up_rows_kernel,
                                       dict(x_ptr=dtype, w_ptr="*i32", gu_ptr="*fp32", scale_ptr=dtype, **index_i64),
                                       dict(rows, ROWS=1, DIRECT=True), **rows_launch),
        "down_rows": compile_report(moe_int4_rows.down_rows_kernel,
                                    dict(gu_ptr="*fp32", w_ptr="*i32", weights_ptr="*fp32", y_ptr="*fp32",
                                         scale_ptr=dtype, **index),
                                    dict(rows, ROWS=2, DIRECT=False, DTYPE=tl.bfloat16), **rows_launch),
        "sum": compile_report(fused_moe_kernels.sum_choices_kernel, dict(y_ptr="*fp32", ids_ptr="*i64", out_ptr=dtype),
                              dict(TOP_K=8, SHARED=1, BLOCK=fused_moe.SUM_BLOCK), num_warps=fused_moe.NUM_WARPS),
    }
