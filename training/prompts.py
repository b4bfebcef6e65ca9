"""Evaluation prompts from the held-out split only: functions' signatures with their docstrings,
and files' opening lines.

    python -m training.prompts --data DATA --out benchmarks/data/demo_prompts.jsonl

Deterministic: files in order of their path hash, at most one prompt of each kind per file.
Prompts end with the last line's text, not a line break: the byte-level BPE merges a line break
with the next line's indentation, so a prompt ending in a bare newline would start the model
from a split it never saw in training (and, at a function body, from column 0).
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import textwrap
from pathlib import Path

from training.corpus import documents

MAX_CHARS = 1200  # keeps prompts well inside the model's training window


def function_prompt(text: str) -> str | None:
    """The first function with a docstring in breadth-first order (top-level functions before
    methods and nested ones): its def line(s) through the docstring, dedented."""
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return None
    lines = text.splitlines()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and ast.get_docstring(node) and node.body:
            doc = node.body[0]
            segment = "\n".join(lines[node.lineno - 1 : doc.end_lineno])
            if 0 < len(segment) <= MAX_CHARS:
                return textwrap.dedent(segment)
    return None


def opening_prompt(text: str, max_lines: int = 12) -> str | None:
    """The file's first lines (at most max_lines and MAX_CHARS)."""
    lines = text.splitlines(keepends=True)[:max_lines]
    while lines and sum(map(len, lines)) > MAX_CHARS:
        lines.pop()
    prompt = "".join(lines).rstrip()
    return prompt if len(prompt) >= 20 else None


def build(heldout: Path, functions: int, openings: int) -> list[dict]:
    docs = sorted(documents(heldout), key=lambda d: hashlib.sha256(d[0].encode()).hexdigest())
    out, counts = [], {"function": 0, "opening": 0}
    for path, text in docs:
        for kind, make, limit in (("function", function_prompt, functions), ("opening", opening_prompt, openings)):
            if counts[kind] < limit:
                prompt = make(text)
                if prompt:
                    out.append({"path": path, "kind": kind, "prompt": prompt})
                    counts[kind] += 1
    if counts["function"] < functions or counts["opening"] < openings:
        raise RuntimeError(f"the held-out split gave only {counts}")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--functions", type=int, default=80)
    parser.add_argument("--openings", type=int, default=40)
    args = parser.parse_args()
    prompts = build(args.data / "heldout.jsonl", args.functions, args.openings)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("".join(json.dumps(p) + "\n" for p in prompts))
    print(f"prompts: {len(prompts)} from the held-out split -> {args.out}")


if __name__ == "__main__":
    main()
