"""Test set-up: Triton kernels run natively on CUDA, and under TRITON_INTERPRET=1 on the CPU."""

import os
import sys
import tempfile
from pathlib import Path

import torch

# benchmarks/ holds tools the tests use too (oracle.py's forced-acceptance drafter)
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

if not torch.cuda.is_available():
    # Must be set before any @triton.jit kernel is defined (triton reads it at decoration time).
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

HAS_CUDA = torch.cuda.is_available()

# Under pytest-xdist every worker would take a thread per core for torch's CPU ops (the float64
# references), so N workers would run N x cores threads on cores: split the cores instead.
_workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _workers > 1:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // _workers))
# Where the Triton kernels run: the GPU when there is one, else the CPU interpreter.
KERNEL_DEVICE = "cuda" if HAS_CUDA else "cpu"


# Engines built by module-scoped fixtures (before the per-test folder below exists) keep their
# round costs in a folder of this test session's, never the user's.
os.environ["DDTREE_CACHE_DIR"] = tempfile.mkdtemp(prefix="ddtree-test-cache-")


@pytest.fixture(autouse=True)
def _own_cache_dir(tmp_path, monkeypatch):
    """Round-cost tables the commands keep (ddtree/cost_cache.py) go to a folder of the test's
    own, never the user's (and none kept by another test or run is read)."""
    monkeypatch.setenv("DDTREE_CACHE_DIR", str(tmp_path / "ddtree-cache"))


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords and not HAS_CUDA:
            item.add_marker(skip)


@pytest.fixture
def kernel_device() -> str:
    return KERNEL_DEVICE


# A test's `device` parameter: CUDA (marked cuda) and the CPU with its kernels interpreted, which
# runs only where there is no GPU (the interpreter is on only there).
CUDA_AND_INTERPRETED = [
    pytest.param("cuda", marks=pytest.mark.cuda),
    pytest.param("cpu", marks=pytest.mark.skipif(HAS_CUDA, reason="runs the kernels interpreted: only without a GPU")),
]


def gpu_or_scaled(gpu: tuple, cpu: tuple, id: str):
    """One case of a kernel test at two sizes: on a GPU the full-size arguments `gpu` (marked cuda,
    so the GPU suite, `-m cuda`, runs it), on the CPU `cpu`, the same case scaled down to seconds
    under the interpreter."""
    if HAS_CUDA:
        return pytest.param(*gpu, marks=pytest.mark.cuda, id=id)
    return pytest.param(*cpu, id=id)


def _attention_backends() -> list[str]:
    """tree_verify_mla backends to test here: the Triton kernel everywhere (the interpreter on the
    CPU), plus the Gluon Hopper kernel on an sm_90 GPU."""
    if HAS_CUDA and torch.cuda.get_device_capability()[0] == 9:
        return ["triton", "hopper"]
    return ["triton"]


def pytest_generate_tests(metafunc):
    if "attention_backend" in metafunc.fixturenames:
        metafunc.parametrize("attention_backend", _attention_backends())
