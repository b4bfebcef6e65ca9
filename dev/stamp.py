"""Stamp this checkout's commit for a machine that gets a copy of the tree without a usable .git
(the device machine): benchmarks/common.py's commit() reads the stamp there, and refuses it once
the code differs from what was stamped.

    python dev/stamp.py          # writes .provenance.json (ignored by git: carry it to the device)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from common import STAMP, code_digest, git_commit  # noqa: E402

if __name__ == "__main__":
    label = git_commit()
    if label == "unknown":
        sys.exit("dev/stamp.py: no git checkout here to stamp")
    STAMP.write_text(json.dumps({"commit": label, "digest": code_digest()}, indent=1) + "\n")
    print(f"{STAMP.name}: {label}")
