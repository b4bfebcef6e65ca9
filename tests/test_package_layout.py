"""Issue 23's rules for the package's structure: no import circle among ddtree's modules (imports
inside functions included) and no private name imported from another module."""

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"


def module_imports(src: Path) -> tuple[dict[str, set[str]], list[tuple[str, str, str]]]:
    """Per module of the packages under src: the modules it imports (static, anywhere in the file),
    and every (importer, module, name) where the name is private."""
    modules = {}
    for path in src.rglob("*.py"):
        name = ".".join(path.relative_to(src).with_suffix("").parts)
        modules[name.removesuffix(".__init__")] = path
    edges, private = {name: set() for name in modules}, []
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found = [(alias.name, None) for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(parts + ([base] if base else []))
                found = [(f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base, a.name) for a in node.names]
            else:
                continue
            for module, imported in found:
                if module in modules and module != name:
                    edges[name].add(module)
                    if imported and imported.startswith("_") and not imported.startswith("__"):
                        private.append((name, module, imported))
    return edges, private


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    state, found = {}, []

    def visit(module, path):
        state[module] = "open"
        for other in sorted(edges[module]):
            if state.get(other) == "open":
                found.append(path[path.index(other):] + [other])
            elif other not in state:
                visit(other, path + [other])
        state[module] = "done"

    for module in sorted(edges):
        if module not in state:
            visit(module, [module])
    return found


def test_ddtree_has_no_import_circle_and_imports_no_private_name():
    edges, private = module_imports(SRC)
    assert len(edges) > 50 and "ddtree.engine.engine" in edges
    assert circles(edges) == []
    assert private == []


def test_the_checks_find_a_circle_and_a_private_import(tmp_path):
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from .b import _helper\n")
    (package / "b.py").write_text("def _helper():\n    from . import a\n")
    edges, private = module_imports(tmp_path)
    assert circles(edges) == [["pkg.a", "pkg.b", "pkg.a"]]
    assert private == [("pkg.a", "pkg.b", "_helper")]
