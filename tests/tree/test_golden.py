"""Frozen reference vectors (tests/golden/make_golden.py): any silent change of the reference,
or a kernel drifting from it, fails here."""

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from ddtree.tree import TREE_FIELDS, DraftTrees, accept_paths, build_trees, topk_logprobs

GOLDEN = Path(__file__).resolve().parents[1] / "golden"
TREE = load_file(GOLDEN / "tree.safetensors")
TOPK = load_file(GOLDEN / "topk.safetensors")
TREE_CASES = sorted({key.split(".")[0] for key in TREE})
TOPK_CASES = sorted({key.split(".")[0] for key in TOPK})


def _case(name):
    return {key.split(".", 1)[1]: t for key, t in TREE.items() if key.startswith(name + ".")}


@pytest.mark.parametrize("name", TREE_CASES)
@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_tree_golden(name, backend, kernel_device):
    case = _case(name)
    device = "cpu" if backend == "reference" else kernel_device
    lp, tok = case["top_logprobs"].to(device), case["top_tokens"].to(device)
    trees = build_trees(lp, tok, int(case["budget"]), backend=backend)
    for field in TREE_FIELDS:
        assert torch.equal(getattr(trees, field).cpu(), case[field]), f"{name}: {field}"
    frozen = DraftTrees(**{f: case[f].to(device) for f in TREE_FIELDS}, max_depth=lp.shape[1])
    walk = accept_paths(frozen, case["posterior"].to(device), backend=backend)
    for got, key in zip(walk, ("accepted", "accept_len", "bonus")):
        assert torch.equal(got.cpu(), case[key]), f"{name}: {key}"


def test_golden_covers_the_edges():
    assert {"ties", "underfull", "chain", "depth1", "budget1", "zero_prob"} <= set(TREE_CASES)
    assert (_case("underfull")["num_nodes"] < int(_case("underfull")["budget"])).all()
    assert (_case("zero_prob")["num_nodes"] == 0).any()
    assert (_case("ties")["accept_len"] > 1).all()


@pytest.mark.parametrize("name", TOPK_CASES)
@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_topk_golden(name, backend, kernel_device):
    device = "cpu" if backend == "reference" else kernel_device
    logits = TOPK[f"{name}.logits"].to(device)
    lp, tok = topk_logprobs(logits, TOPK[f"{name}.tokens"].shape[-1], backend=backend)
    assert torch.equal(tok.cpu(), TOPK[f"{name}.tokens"])
    torch.testing.assert_close(lp.cpu(), TOPK[f"{name}.logprobs"], rtol=0, atol=4e-6)
