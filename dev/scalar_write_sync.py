"""Does writing one value into a CUDA tensor wait for the kernels already queued? Host time of
`t[i] = v` (a Python number), of a copy from a page-locked one-element tensor, and of
BatchState.vacate, each issued while about 50 ms of matmuls are queued on the stream.

    python dev/scalar_write_sync.py
"""

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from ddtree.engine.batch import BatchState  # noqa: E402


def queue_work(a):
    for _ in range(40):
        a = a @ a
        a = a / a.norm()
    return a


def host_ms(write, a):
    torch.cuda.synchronize()
    queue_work(a)
    start = time.perf_counter()
    write()
    ms = (time.perf_counter() - start) * 1e3
    torch.cuda.synchronize()
    return ms


def main():
    a = torch.randn(4096, 4096, device="cuda")
    t = torch.zeros(32, dtype=torch.int64, device="cuda")
    state = BatchState(32, 4, torch.device("cuda"))
    queue_work(a)
    torch.cuda.synchronize()
    start = time.perf_counter()
    queue_work(a)
    torch.cuda.synchronize()
    print(f"queued work alone: {(time.perf_counter() - start) * 1e3:.1f} ms")
    for name, write in [("t[3] = 7 (Python number)", lambda: t.__setitem__(3, 7)),
                        ("copy from page-locked, non_blocking",
                         lambda: t[3:4].copy_(torch.tensor([7]).pin_memory(), non_blocking=True)),
                        ("BatchState.vacate", lambda: state.vacate(3))]:
        times = sorted(host_ms(write, a) for _ in range(5))
        print(f"{name:40s} host ms while work is queued: median {times[2]:.3f}, max {times[-1]:.3f}")


if __name__ == "__main__":
    main()
