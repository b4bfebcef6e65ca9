"""Round-cost tables kept between runs of `ddtree generate` and `ddtree serve`.

budget="auto" needs the engine's cost table (engine/costs.py), and measuring it takes seconds on
the H200 and half a minute for the demo pair on a small CPU: more than a short generate itself.
The commands keep what they measured in a cache folder, one file per pair signature (models'
shapes, dtype, device, graphs, page size, overlap) and ddtree version, and load it the next time.
Real steps' distance from the table is learned online anyway (costs.StepCorrection), so a table
measured on another day on the same kind of device is a fair start. `--fresh-costs` measures again.
The folder is $DDTREE_CACHE_DIR, else $XDG_CACHE_HOME/ddtree, else ~/.cache/ddtree.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

from . import __version__


def cache_dir() -> Path:
    if os.environ.get("DDTREE_CACHE_DIR"):
        return Path(os.environ["DDTREE_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "ddtree"


def table_path(signature: dict) -> Path:
    """The cache file of the table for an engine with this pair_signature."""
    key = json.dumps({"signature": signature, "ddtree": __version__}, sort_keys=True)
    return cache_dir() / "round_costs" / f"{hashlib.sha256(key.encode()).hexdigest()[:20]}.json"


def load_cached_costs(engine, fresh: bool = False) -> Path | None:
    """Give the engine's sizer the cached table, if there is one and not `fresh`; returns the
    cache file to keep the table in (None for an engine without tree rounds). A file that cannot
    be read is measured over."""
    if engine.sizer is None:
        return None
    from .engine.costs import RoundCosts

    path = table_path(engine.signature)
    if not fresh and path.exists():
        try:
            engine.sizer.add_costs(RoundCosts.load(path, engine.signature))
        except (OSError, ValueError) as err:
            print(f"ddtree: warning: ignoring the cached round costs {path} ({err}); measuring again", file=sys.stderr)
    return path


def save_cached_costs(engine, path: Path | None) -> None:
    """Write the engine's table to `path` (atomically) when it has one; a folder that cannot be
    written is a warning, never a failure."""
    if path is None or engine.sizer is None or engine.sizer.costs is None:
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(f".{os.getpid()}.tmp")
        engine.sizer.costs.save(partial)
        os.replace(partial, path)
    except OSError as err:
        print(f"ddtree: warning: could not keep the round costs in {path.parent} ({err})", file=sys.stderr)
