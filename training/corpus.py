"""The demo pair's corpus: Python source of the running interpreter's standard library and of a
fixed list of installed packages, split by file into training and held-out sets.

    python -m training.corpus --out DATA            # DATA/train.jsonl, heldout.jsonl, manifest.json

The split is a hash of each file's path relative to its root ("stdlib/json/decoder.py"), so it is
the same on any machine and Python version: a held-out path was never trained on anywhere.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import importlib.util
import json
import platform
import sys
import sysconfig
from pathlib import Path

PACKAGES = ("numpy", "scipy", "sympy", "pandas", "networkx", "sklearn", "matplotlib", "setuptools")
DISTRIBUTIONS = {"sklearn": "scikit-learn"}
HELDOUT_PERCENT = 6  # of files, by path hash (the bar is at least 5%)
MAX_FILE_BYTES = 1 << 20  # a few generated tables are larger; they would dominate the corpus
# Vendored copies of other projects live under several roots at once, and the stdlib's generated
# codecs are near-copies of each other: under a split by path, one copy could be held out while
# its twin is trained on. They are left out, and files whose bytes repeat an earlier file are too.
VENDORED_DIRS = frozenset({"_vendor", "vendor", "vendored", "externals", "_external", "extern"})


def left_out(root: str, relative: str) -> bool:
    parts = relative.split("/")
    return bool(VENDORED_DIRS.intersection(parts[:-1])) or (root == "stdlib" and parts[0] == "encodings")


def is_heldout(root: str, relative: str) -> bool:
    digest = hashlib.sha256(f"{root}/{relative}".encode()).digest()
    return int.from_bytes(digest[:8], "big") % 100 < HELDOUT_PERCENT


def roots(packages=PACKAGES) -> dict[str, Path]:
    """{root name: directory}: the stdlib (without site-packages) and each package's directory."""
    found = {"stdlib": Path(sysconfig.get_paths()["stdlib"])}
    for name in packages:
        spec = importlib.util.find_spec(name)
        if spec is None or not spec.submodule_search_locations:
            raise ModuleNotFoundError(f"package {name} is not installed: the corpus needs it")
        found[name] = Path(list(spec.submodule_search_locations)[0])
    return found


def python_files(name: str, root: Path):
    """(relative path, file path) of the root's .py files in sorted order; stdlib skips installed packages."""
    for path in sorted(root.rglob("*.py")):
        relative = path.relative_to(root).as_posix()
        if name == "stdlib" and relative.split("/")[0] in ("site-packages", "dist-packages"):
            continue
        yield relative, path


def collect(out: Path, packages=PACKAGES) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    manifest = {"python": platform.python_version(), "implementation": sys.implementation.name,
                "heldout_percent": HELDOUT_PERCENT, "max_file_bytes": MAX_FILE_BYTES, "roots": {}}
    seen: set[bytes] = set()  # content hashes: a file repeated under two roots is kept once
    with open(out / "train.jsonl", "w") as train, open(out / "heldout.jsonl", "w") as held:
        for name, root in roots(packages).items():
            version = platform.python_version() if name == "stdlib" else importlib.metadata.version(DISTRIBUTIONS.get(name, name))
            stats = {"version": version, "path": str(root), "train_files": 0, "heldout_files": 0,
                     "train_bytes": 0, "heldout_bytes": 0, "skipped_large": 0, "skipped_undecodable": 0,
                     "skipped_vendored_or_generated": 0, "skipped_duplicate": 0}
            for relative, path in python_files(name, root):
                if left_out(name, relative):
                    stats["skipped_vendored_or_generated"] += 1
                    continue
                raw = path.read_bytes()
                digest = hashlib.sha256(raw).digest()
                if digest in seen:
                    stats["skipped_duplicate"] += 1
                    continue
                seen.add(digest)
                if len(raw) > MAX_FILE_BYTES:
                    stats["skipped_large"] += 1
                    continue
                try:
                    text = raw.decode("utf-8")
                except UnicodeDecodeError:
                    stats["skipped_undecodable"] += 1
                    continue
                if not text.strip():
                    continue
                split = "heldout" if is_heldout(name, relative) else "train"
                (held if split == "heldout" else train).write(json.dumps({"path": f"{name}/{relative}", "text": text}) + "\n")
                stats[f"{split}_files"] += 1
                stats[f"{split}_bytes"] += len(raw)
            manifest["roots"][name] = stats
    totals = {k: sum(r[k] for r in manifest["roots"].values()) for k in ("train_files", "heldout_files", "train_bytes", "heldout_bytes")}
    manifest["totals"] = totals
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1))
    return manifest


def documents(path: Path):
    """Yield (path, text) of a .jsonl split."""
    with open(path) as f:
        for line in f:
            record = json.loads(line)
            yield record["path"], record["text"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--packages", nargs="*", default=list(PACKAGES), help="installed packages to include")
    args = parser.parse_args()
    manifest = collect(args.out, tuple(args.packages))
    t = manifest["totals"]
    share = t["heldout_files"] / max(1, t["train_files"] + t["heldout_files"])
    print(f"corpus: {t['train_files']} training files ({t['train_bytes'] / 1e6:.1f} MB), {t['heldout_files']} "
          f"held out ({t['heldout_bytes'] / 1e6:.1f} MB, {100 * share:.1f}% of files), Python {manifest['python']}")


if __name__ == "__main__":
    main()
