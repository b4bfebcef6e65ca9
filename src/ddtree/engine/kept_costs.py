"""Round-cost tables kept between runs: every engine's, the API's as the commands'.

budget="auto" needs the engine's cost table (engine/costs.py), and measuring it takes seconds on
the H200 and half a minute or more for the demo pair on a small CPU: more than a short generate
itself. An engine keeps what it measured in a cache folder, one file per pair signature
(costs.pair_signature) and ddtree version, and loads it the next time
(Engine(kept_costs=...): "use", "fresh" to measure again, "off"). Real steps' distance from the
table is learned online anyway (costs.StepCorrection), so a table measured on another day on the
same kind of device is a fair start. The folder is $DDTREE_CACHE_DIR, else
$XDG_CACHE_HOME/ddtree, else ~/.cache/ddtree. The commands also keep Triton's compiled kernels
under $DDTREE_CACHE_DIR when it is set (share_with_triton).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

from ..version import __version__

log = logging.getLogger("ddtree.engine")


def cache_dir() -> Path:
    if os.environ.get("DDTREE_CACHE_DIR"):
        return Path(os.environ["DDTREE_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "ddtree"


def share_with_triton() -> None:
    """With $DDTREE_CACHE_DIR set and $TRITON_CACHE_DIR not, Triton keeps its compiled kernels in
    $DDTREE_CACHE_DIR/triton (it reads the variable at each compile): one folder that a restart
    reuses, a container's kept volume say, holds both. Else Triton's own default (~/.triton/cache)."""
    if os.environ.get("DDTREE_CACHE_DIR") and not os.environ.get("TRITON_CACHE_DIR"):
        os.environ["TRITON_CACHE_DIR"] = str(cache_dir() / "triton")


def table_path(signature: dict) -> Path:
    """The cache file of the table for an engine with this pair_signature."""
    key = json.dumps({"signature": signature, "ddtree": __version__}, sort_keys=True)
    return cache_dir() / "round_costs" / f"{hashlib.sha256(key.encode()).hexdigest()[:20]}.json"


def kept_table(signature: dict):
    """The table kept for an engine with this pair_signature (a RoundCosts), or None: none kept,
    or one that cannot be read (a warning; it is measured over)."""
    from .costs import RoundCosts

    path = table_path(signature)
    if not path.exists():
        return None
    try:
        return RoundCosts.load(path, signature)
    except (OSError, ValueError) as err:
        log.warning("ignoring the kept round costs %s (%s); measuring again", path, err)
        return None


def keep_table(table, signature: dict) -> Path | None:
    """Write `table` (a RoundCosts) where kept_table finds it, atomically; returns the file, or
    None when the folder cannot be written (a warning, never a failure)."""
    path = table_path(signature)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(f".{os.getpid()}.tmp")
        table.save(partial)
        os.replace(partial, path)
    except OSError as err:
        log.warning("could not keep the round costs in %s (%s)", path.parent, err)
        return None
    return path
