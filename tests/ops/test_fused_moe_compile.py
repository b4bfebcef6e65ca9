"""The fused MoE kernels, compiled for sm_90 here (no GPU needed): the alignment's sort, histogram
and gather lower for the GPU, and the GEMMs run on tensor cores with pipelined loads and no spills."""

import sys

import pytest

from ..sm90_assembly import compiled_in_fresh_interpreter

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Triton's CUDA toolchain ships for Linux")


@pytest.fixture(scope="module")
def reports() -> dict:
    return compiled_in_fresh_interpreter(
        "import json; from tests.ops.fused_moe_compile import all_reports; print(json.dumps(all_reports()))")


def test_no_kernel_spills(reports):
    for name, report in reports.items():
        assert report["spill_bytes"] == 0 and report["registers"] <= 255, (name, report)


def test_a_wide_alignment_shares_its_sort_over_more_warps(reports):
    """One program sorts every pair: at a verify's 4096 pairs it runs alone on one multiprocessor,
    so align_warps gives it more warps, each with a third of the instructions or fewer."""
    wide, narrow = reports["align_wide"], reports["align_wide_4_warps"]
    assert 3 * wide["instructions"] <= narrow["instructions"], (wide, narrow)


def test_gemms_use_tensor_cores_and_pipelined_loads(reports):
    for name in ("gate_up", "down", "gate_up_direct", "down_direct", "gate_up_int4", "down_int4",
                 "gate_up_int4_pairs", "down_int4_pairs", "gate_up_int4_interleaved", "down_int4_interleaved",
                 "gate_up_int4_interleaved_many", "down_int4_interleaved_many", "gate_up_int4_interleaved_many_step128",
                 "down_int4_interleaved_many_step128"):
        report = reports[name]
        assert report["mma"] > 0, (name, report)
        assert report["shared"] <= 232448, (name, report)  # the sm_90 opt-in limit per block (227 KB)
        assert report["async_copies"] > 0, (name, report)  # loads of the next K step overlap the MMAs
        if name.endswith(("int4", "pairs")):  # each row's packed words read as 16-byte vectors
            assert report["word_vector_copies"] > 0, (name, report)


def test_int4_tiles_wait_on_no_load_and_interleaved_ones_stay_in_registers(reports):
    """With the scales two to an int32 word (int4_tiles._scale_pairs) the pipeliner copies every
    tile load of the pairs kernels ahead (one bf16 per word was a 2-byte load it left in the step);
    the interleaved order's weights go from their loaded words to the MMA in registers, where the
    pairs tile is stored to shared memory first."""
    interleaved = ("gate_up_int4_interleaved", "down_int4_interleaved", "gate_up_int4_interleaved_many",
                   "down_int4_interleaved_many", "gate_up_int4_interleaved_many_step128",
                   "down_int4_interleaved_many_step128")
    for name in ("gate_up_int4_pairs", "down_int4_pairs", *interleaved):
        assert reports[name]["blocking_tile_loads"] == 0, (name, reports[name])
    for name in interleaved:  # nor between threads: a half block's groups relabel within each thread
        report = reports[name]
        assert report["stored_register_tiles"] == report["loop_shared_stores"] == report["loop_shuffles"] == 0, \
            (name, report)
    pairs = reports["gate_up_int4_pairs"]  # the contrast the order removes
    assert pairs["stored_register_tiles"] > 0 and pairs["loop_shared_stores"] > 0, pairs


def test_no_kernel_serializes_its_wgmmas(reports):
    """ptxas runs wgmmas back to back unless an instruction other than a wgmma defines an
    accumulator while one may be in flight; then it makes every wgmma of the kernel wait for the
    last (advisory C7515). The interleaved INT4 tiles met this through their K loop's zero-trip
    path (zeros handed to the epilogue past a pending wgmma) until tl.assume ruled that path out."""
    serialized = [name for name, report in reports.items() if report["serialized_wgmma"]]
    assert not serialized, serialized


def test_int4_row_kernels_read_words_as_vectors(reports):
    """The row kernels load each row's packed words (this step's and the next's) and the activations
    16 bytes at a time: at least 3 such loads in gate_up_rows' PTX and 5 in down_rows' (its
    activations are gate and up, float32); with a masked K step (EVEN_K off) only the activations'
    loads are left vectorized. Without the shared experts' tl.dot branch, neither stages tiles in
    shared memory."""
    assert reports["gate_up_rows"]["vector_loads"] >= 3, reports["gate_up_rows"]
    assert reports["down_rows"]["vector_loads"] >= 5, reports["down_rows"]
    for name in ("gate_up_rows", "down_rows"):
        assert reports[name]["mma"] == 0 and reports[name]["registers"] <= 168, (name, reports[name])


def test_every_kernel_waits_for_its_producer_first(reports):
    """Launched with programmatic dependent launch on the H200 (ops/launch.py): each kernel's PTX has
    the grid-dependency wait that keeps it from reading its inputs before the previous kernel ends."""
    assert set(reports) == {"align", "align_wide_4_warps", "align_wide", "gate_up", "down", "gate_up_direct",
                            "down_direct", "gate_up_int4", "down_int4", "gate_up_int4_pairs", "down_int4_pairs",
                            "gate_up_int4_interleaved", "down_int4_interleaved", "gate_up_int4_interleaved_many",
                            "down_int4_interleaved_many", "gate_up_int4_interleaved_many_step128",
                            "down_int4_interleaved_many_step128", "gate_up_rows", "down_rows", "sum"}
    for name, report in reports.items():
        assert report["pdl_waits"] >= 1 and report["waits_first"], (name, report)
