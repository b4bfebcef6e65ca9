"""Summarise dev/round_before_after.sh: graph-replay medians of the ar step and the ddtree round per run."""
import json
import statistics
import sys
from pathlib import Path

out = Path(sys.argv[1])
rows = {}
for run in sorted(out.glob("*/engine_round-*.json")):
    data = json.loads(run.read_text())
    side = run.parent.name.rstrip("0123456789")
    for cell in data["cells"]:
        key = (cell["B"], cell["mode"], cell["budget"])
        rows.setdefault(key, {}).setdefault(side, []).append(cell["graph"]["round"]["median"])
    commit = data["environment"].get("commit")
    print(f"- {run.parent.name}: commit {commit}, {data['environment'].get('gpu')}")
print("\n| B | mode | budget | before us (runs) | after us (runs) | after / before (medians) |\n|---|---|---|---|---|---|")
for (batch, mode, budget), sides in sorted(rows.items()):
    before, after = sides.get("before", []), sides.get("after", [])
    ratio = statistics.median(after) / statistics.median(before) if before and after else float("nan")
    fmt = lambda xs: ", ".join(f"{x:.1f}" for x in xs)
    print(f"| {batch} | {mode} | {budget} | {fmt(before)} | {fmt(after)} | {ratio:.4f} |")
