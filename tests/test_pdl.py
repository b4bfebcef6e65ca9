"""ddtree.pdl's switch: off wherever it cannot apply (the CPU, the interpreter), off by DDTREE_PDL=0.
That each kernel waits for its producer before it touches memory is checked in the sm_90 compile
tests (tests/models/*_compile.py, tests/attention/hopper_compile.py) with waits_before_memory,
itself checked here; that PDL changes no result, on the H200 (dev/round_variants.py)."""

import os
import subprocess
import sys

import torch
from triton import knobs

from ddtree import pdl

from .sm90_assembly import waits_before_memory


def test_off_on_the_cpu_and_under_the_interpreter(monkeypatch):
    off = dict(PDL=False, launch_pdl=False)
    monkeypatch.setattr(pdl, "ENABLED", True)
    assert pdl.launch_flags(torch.device("cpu")) == off
    monkeypatch.setattr(knobs.runtime, "interpret", True)
    assert pdl.launch_flags(torch.device("cuda")) == off  # the interpreter runs no PTX (no GPU is asked)
    monkeypatch.setattr(knobs.runtime, "interpret", False)
    monkeypatch.setattr(pdl, "ENABLED", False)
    assert pdl.launch_flags(torch.device("cuda")) == off  # the switch


def test_the_ptx_check_sees_memory_touched_before_the_wait():
    assert waits_before_memory("mov.u32 %r1, 0;\n griddepcontrol.wait; // dummy\n ld.global.b32 %r2, [%rd1];")
    assert waits_before_memory("griddepcontrol.wait;\n cp.async.bulk.tensor.2d.shared::cluster.global [%r1];")
    assert not waits_before_memory("ld.global.b32 %r2, [%rd1];\n griddepcontrol.wait;")
    assert not waits_before_memory("cp.async.cg.shared.global [%r1], [%rd1], 16;\n griddepcontrol.wait;")
    assert not waits_before_memory("st.global.b32 [%rd1], %r2;")  # no wait at all


def test_environment_variable_turns_it_off():
    code = "from ddtree import pdl; print(pdl.ENABLED)"
    for value, want in (("0", "False"), ("1", "True")):
        env = {**os.environ, "DDTREE_PDL": value}
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
        assert out.stdout.strip() == want, (value, out.stdout, out.stderr)
