"""tree_verify_mla refuses bad input with an error that names what was wrong."""

import pytest
import torch

from ddtree.attention import choose_num_splits, tree_verify_mla

from ..conftest import KERNEL_DEVICE
from .cases import Case, make_inputs


def _inputs():
    """Valid inputs where the kernel runs (the GPU, else the CPU interpreter)."""
    return list(make_inputs(Case(heads=16, prefixes=[20, 5], tree_rows=[4, 3], rows=4), KERNEL_DEVICE))


@pytest.mark.parametrize(
    "index,bad,error,match",
    [
        (0, lambda q: q[0], ValueError, r"q must be \[B, N, H, D\]"),
        (0, lambda q: q.float(), TypeError, "bf16 or fp16"),
        (1, lambda kv: kv.half(), TypeError, "kv_cache dtype"),
        (1, lambda kv: kv[..., :512], ValueError, "kv_cache must be"),
        (2, lambda bt: bt.long(), TypeError, "block_table must be torch.int32"),
        (3, lambda pl: pl[:1], ValueError, "prefix_lens must have shape"),
        (4, lambda nn: nn.float(), TypeError, "num_rows must be"),
        (5, lambda vis: vis[:, :3], ValueError, "visibility must have shape"),
    ],
)
def test_shape_and_dtype_errors(index, bad, error, match):
    args = _inputs()
    args[index] = bad(args[index])
    with pytest.raises(error, match=match):
        tree_verify_mla(*args, 0.1)


def test_value_errors():
    args = _inputs()
    args[4] = torch.tensor([5, 3], dtype=torch.int32, device=KERNEL_DEVICE)  # more rows than N = 4
    with pytest.raises(ValueError, match=r"num_rows must be in \[0, N=4\]"):
        tree_verify_mla(*args, 0.1)
    args = _inputs()
    args[2] = args[2][:, :1]  # request 0 needs 2 pages of 16 for 20 + 4 tokens
    with pytest.raises(ValueError, match="block_table has 1 pages per request but request 0 needs 2"):
        tree_verify_mla(*args, 0.1)
    args = _inputs()
    args[2] = args[2].clone()
    args[2][1, 0] = 10_000
    with pytest.raises(ValueError, match=r"block_table\[1, 0\] = 10000 is not a page"):
        tree_verify_mla(*args, 0.1)
    with pytest.raises(ValueError, match="num_splits"):
        tree_verify_mla(*_inputs(), 0.1, num_splits=0)


def test_tree_node_count_in_place_of_rows_is_refused():
    """DraftTrees.num_nodes leaves the root out; the kernel's num_rows counts it. Passing the
    former would silently drop each tree's last node, so the checked path refuses it."""
    args = _inputs()  # trees of 3 and 2 nodes: num_rows [4, 3]
    args[4] = args[4] - 1  # what a caller passing trees.num_nodes would give
    with pytest.raises(ValueError, match=r"visibility row 3 of request 0 is set but num_rows\[0\] = 3"):
        tree_verify_mla(*args, 0.1)


def test_split_choice_depends_on_shapes_only():
    cpu = torch.device("cpu")  # the interpreter stands in with 8 multiprocessors
    assert choose_num_splits(64, 65 * 64, 4096, cpu) == 1  # plenty of row tiles
    assert choose_num_splits(1, 16 * 64, 32768, cpu) == 1  # 16 tiles already fill 2 x 8
    assert choose_num_splits(1, 64, 32768, cpu) == 16  # one tile: split to fill
    assert choose_num_splits(1, 64, 300, cpu) == 1  # too few keys to split


def test_backend_errors():
    with pytest.raises(ValueError, match="backend must be one of"):
        tree_verify_mla(*_inputs(), 0.1, backend="cuda")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="the hopper backend cannot run here: it needs a CUDA device"):
            tree_verify_mla(*_inputs(), 0.1, backend="hopper")


@pytest.mark.cuda
def test_hopper_backend_refuses_what_tma_cannot_read():
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the hopper backend needs an sm_90 GPU")
    args = _inputs()
    q = args[0]
    args[0] = torch.empty(q.shape[0], q.shape[2], q.shape[1], q.shape[3], dtype=q.dtype, device=q.device).transpose(1, 2)
    args[0].copy_(q)  # same values, not contiguous
    with pytest.raises(ValueError, match="needs a contiguous q"):
        tree_verify_mla(*args, 0.1, backend="hopper")
    want, _ = tree_verify_mla(q, *args[1:], 0.1)
    got, _ = tree_verify_mla(*args, 0.1)  # auto falls back to the triton kernel
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
