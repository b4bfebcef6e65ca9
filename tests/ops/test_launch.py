"""ops/launch.py: PDL is off wherever it cannot apply (the CPU, the interpreter) and where the
policy turns it off. That each kernel waits for its producer before it touches memory is checked
in the sm_90 compile tests (tests/ops/*_compile.py, tests/attention/hopper_compile.py) with
waits_before_memory, itself checked here; that PDL changes no result, on the H200
(dev/round_variants.py)."""

import torch
from triton import knobs

from ddtree.ops.launch import launch_flags

from ..sm90_assembly import waits_before_memory


def test_off_on_the_cpu_under_the_interpreter_and_when_not_asked(monkeypatch):
    off = dict(PDL=False, launch_pdl=False)
    assert launch_flags(torch.device("cpu")) == off
    monkeypatch.setattr(knobs.runtime, "interpret", True)
    assert launch_flags(torch.device("cuda")) == off  # the interpreter runs no PTX (no GPU is asked)
    monkeypatch.setattr(knobs.runtime, "interpret", False)
    assert launch_flags(torch.device("cuda"), pdl=False) == off  # the policy's switch


def test_the_ptx_check_sees_memory_touched_before_the_wait():
    assert waits_before_memory("mov.u32 %r1, 0;\n griddepcontrol.wait; // dummy\n ld.global.b32 %r2, [%rd1];")
    assert waits_before_memory("griddepcontrol.wait;\n cp.async.bulk.tensor.2d.shared::cluster.global [%r1];")
    assert not waits_before_memory("ld.global.b32 %r2, [%rd1];\n griddepcontrol.wait;")
    assert not waits_before_memory("cp.async.cg.shared.global [%r1], [%rd1], 16;\n griddepcontrol.wait;")
    assert not waits_before_memory("st.global.b32 [%rd1], %r2;")  # no wait at all
