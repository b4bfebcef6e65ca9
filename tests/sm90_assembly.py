"""Compile tests (no GPU needed): assemble a Triton-compiled kernel for sm_90a with Triton's own
ptxas and read it back, and run a report builder in a fresh interpreter."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def assemble(compiled) -> dict:
    """compiled: triton.compile's result for a cuda sm_90 target -> {"registers", "spill_bytes",
    "sass", "serialized_wgmma"}: registers per thread and spilled bytes from `ptxas -v`, SASS from
    cuobjdump; serialized_wgmma: ptxas made every wgmma of the kernel wait for the last (its
    performance advisory C7515, e.g. for an accumulator other instructions define mid-flight)."""
    import triton  # a Linux-only dependency: imported when a kernel is assembled

    nvidia_bin = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    with tempfile.TemporaryDirectory() as tmp:
        ptx, cubin = Path(tmp) / "k.ptx", Path(tmp) / "k.cubin"
        ptx.write_text(compiled.asm["ptx"])
        info = subprocess.run([str(nvidia_bin / "ptxas"), "-v", "-arch=sm_90a", str(ptx), "-o", str(cubin)],
                              capture_output=True, text=True, check=True).stderr
        cubin.write_bytes(compiled.asm["cubin"])
        sass = subprocess.run([str(nvidia_bin / "cuobjdump"), "-sass", str(cubin)],
                              capture_output=True, text=True, check=True).stdout
    return {"registers": int(re.search(r"Used (\d+) registers", info)[1]),
            "spill_bytes": sum(int(n) for n in re.findall(r"(\d+) bytes spill stores", info)), "sass": sass,
            "serialized_wgmma": "C7515" in info}


def compiled_in_fresh_interpreter(code: str):
    """Run `code` (Python that prints one JSON value last) in a fresh interpreter from the repo
    root without TRITON_INTERPRET: under it Triton's library functions (tl.sort, gl.max's combine)
    are interpreter objects that the compiler refuses. Returns the parsed value; a failure fails
    the calling test with the child's stderr."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True)
    if done.returncode:
        pytest.fail(done.stderr[-3000:])
    return json.loads(done.stdout.splitlines()[-1])


GLOBAL_ACCESS = re.compile(r"\b(?:(?:ld|st|atom|red)\.global|cp\.async|cp\.reduce\.async)")


def waits_before_memory(ptx: str) -> bool:
    """Whether the PTX's first griddepcontrol.wait (ops/launch.py) comes before its first global
    memory access (load, store, atomic, async or bulk copy): the rule of a kernel launched with
    programmatic dependent launch. False when there is no wait."""
    wait = ptx.find("griddepcontrol.wait")
    first = GLOBAL_ACCESS.search(ptx)
    return wait >= 0 and (first is None or wait < first.start())



def longest_loop(sass: str) -> list[str]:
    """The SASS instructions (opcode and operands) of the longest loop body: from the target of a
    backward branch to the branch, the longest such span (a kernel's main K loop)."""
    addressed = [(int(m[1], 16), m[2].strip()) for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]
    best = None
    for at, text in addressed:
        m = re.search(r"\bBRA\s+0x([0-9a-f]+)", text)
        if m and int(m[1], 16) < at and (best is None or at - int(m[1], 16) > best[1] - best[0]):
            best = (int(m[1], 16), at)
    return [] if best is None else [text for at, text in addressed if best[0] <= at <= best[1]]
