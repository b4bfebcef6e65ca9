"""ddtree.pdl's switch: off wherever it cannot apply (the CPU, the interpreter), off by DDTREE_PDL=0.
That the kernels wait for their producer first is checked in their sm_90 compile tests
(griddepcontrol.wait in the PTX); that it changes no result, on the H200 (dev/round_variants.py)."""

import os
import subprocess
import sys

import torch

from ddtree import pdl


def test_off_on_the_cpu_and_under_the_interpreter(monkeypatch):
    assert pdl.launch_flags(torch.device("cpu")) == dict(PDL=False, launch_pdl=False)
    monkeypatch.setattr(pdl, "ENABLED", False)
    assert pdl.launch_flags(torch.device("cuda")) == dict(PDL=False, launch_pdl=False)  # the switch first: no GPU asked


def test_environment_variable_turns_it_off():
    code = "from ddtree import pdl; print(pdl.ENABLED)"
    for value, want in (("0", "False"), ("1", "True")):
        env = {**os.environ, "DDTREE_PDL": value}
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
        assert out.stdout.strip() == want, (value, out.stdout, out.stderr)
