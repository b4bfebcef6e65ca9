"""Compile the Gluon tree-verify kernel for sm_90 on a machine without a GPU and print what the
hardware would get. Usage (from the repo root, TRITON_INTERPRET unset):

    PYTHONPATH=src python dev/compile_hopper.py [page_rows=64] [epilogue=2]
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.attention.hopper_compile import compile_report  # noqa: E402

page_rows = int(sys.argv[1]) if len(sys.argv) > 1 else 64
epilogue = int(sys.argv[2]) if len(sys.argv) > 2 else 2
report = compile_report(page_rows, epilogue)
Path("/tmp/hopper.ttgir").write_text(report.pop("ttgir"))
print(report, "(ttgir in /tmp/hopper.ttgir)")
