"""benchmarks/client_pool.py's process CPU readings (Linux /proc)."""

import multiprocessing
import os
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from client_pool import ClientPool, ServerCpu, children, cpu_seconds  # noqa: E402

pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")


def _spin(seconds: float) -> None:
    end = time.process_time() + seconds
    while time.process_time() < end:
        pass


def test_cpu_seconds_count_this_process_and_a_child_is_found():
    before = cpu_seconds(os.getpid())
    _spin(0.3)
    assert cpu_seconds(os.getpid()) - before >= 0.25
    child = multiprocessing.get_context("spawn").Process(target=_spin, args=(30.0,))
    child.start()
    try:
        assert child.pid in children(os.getpid())
        cpu = ServerCpu(os.getpid())
        cpu.start()
        start = time.perf_counter()
        _spin(0.5)
        used = cpu.fractions(time.perf_counter() - start)
        assert used["http_cpu"] > 0.2 and used["core_cpu"] > 0.05, used  # this process, and the spinning child
    finally:
        child.terminate()
        child.join()
    assert cpu_seconds(child.pid) == 0.0  # gone: nothing to read
    with pytest.raises(ValueError, match="client processes must be >= 1, got 0"):
        ClientPool(0)
