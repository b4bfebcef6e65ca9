"""Does a shape's time in benchmarks/verify_attention.py depend on what ran before it? Times
B64 / prefix 512 / N16 fresh, after the heaviest shape of the grid (with its SDPA), and again."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from common import measure_ceilings  # noqa: E402
from verify_attention import measure  # noqa: E402

ceilings = measure_ceilings()
for shape in [(64, 512, 16), (32, 32768, 65), (64, 512, 16), (64, 512, 16)]:
    row = measure(*shape, ceilings)
    print("PROBE", shape, f"ours {row['ours_us']:.1f} us, sdpa {row.get('sdpa_us') or 0:.1f} us", flush=True)
