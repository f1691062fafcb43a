"""The package's shape: an acyclic import graph built from the source, no function-local
imports of jaxkv modules, and flags parsed only in ``jaxkv/cli/``."""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "jaxkv"


def _modules() -> dict[str, Path]:
    mods = {}
    for file in PACKAGE.rglob("*.py"):
        parts = list(file.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        mods[".".join(parts)] = file
    return mods


MODULES = _modules()


def _imported(node: ast.AST, module: str, file: Path) -> list[str]:
    """The jaxkv modules an import statement names (a package's ``__init__`` for its names)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name.split(".")[0] == "jaxkv"]
    if not isinstance(node, ast.ImportFrom):
        return []
    base = node.module or ""
    if node.level:
        package = module.split(".") if file.name == "__init__.py" else module.split(".")[:-1]
        package = package[: len(package) - node.level + 1]
        base = ".".join(package + ([base] if base else []))
    if base.split(".")[0] != "jaxkv":
        return []
    return [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]


def _graph() -> dict[str, set[str]]:
    graph = {}
    for module, file in MODULES.items():
        tree = ast.parse(file.read_text(), str(file))
        graph[module] = {
            target
            for node in ast.walk(tree)
            for target in _imported(node, module, file)
            if target != module
        }
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the graph (a list of modules), or None."""
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_the_checker_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_import_graph_is_acyclic():
    assert _cycle(_graph()) is None


def _function_local_imports() -> list[str]:
    found = []
    for module, file in MODULES.items():
        for fn in ast.walk(ast.parse(file.read_text(), str(file))):
            if isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
                for node in ast.walk(fn):
                    if _imported(node, module, file):
                        found.append(f"{module}.{fn.name}: line {node.lineno}")
    return found


def test_no_function_local_imports_of_jaxkv_modules():
    assert _function_local_imports() == []


@pytest.mark.parametrize("module", sorted(m for m in MODULES if not m.startswith("jaxkv.cli")))
def test_only_the_cli_parses_flags(module):
    tree = ast.parse(MODULES[module].read_text())
    names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    names |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert "argparse" not in names
