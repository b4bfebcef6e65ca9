"""Assemble a Triton-compiled kernel for sm_90a with Triton's own ptxas and read it back: the
register and spill report and the SASS that the compile tests (no GPU needed) inspect."""

from __future__ import annotations

import re
import subprocess
import tempfile
from pathlib import Path

import triton

NVIDIA_BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"


def assemble(compiled) -> dict:
    """compiled: triton.compile's result for a cuda sm_90 target -> {"registers", "spill_bytes",
    "sass"}: registers per thread and spilled bytes from `ptxas -v`, SASS from cuobjdump."""
    with tempfile.TemporaryDirectory() as tmp:
        ptx, cubin = Path(tmp) / "k.ptx", Path(tmp) / "k.cubin"
        ptx.write_text(compiled.asm["ptx"])
        info = subprocess.run([str(NVIDIA_BIN / "ptxas"), "-v", "-arch=sm_90a", str(ptx), "-o", str(cubin)],
                              capture_output=True, text=True, check=True).stderr
        cubin.write_bytes(compiled.asm["cubin"])
        sass = subprocess.run([str(NVIDIA_BIN / "cuobjdump"), "-sass", str(cubin)],
                              capture_output=True, text=True, check=True).stdout
    return {"registers": int(re.search(r"Used (\d+) registers", info)[1]),
            "spill_bytes": sum(int(n) for n in re.findall(r"(\d+) bytes spill stores", info)), "sass": sass}
