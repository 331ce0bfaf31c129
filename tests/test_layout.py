"""The package's layout: imports run one way (no cycle anywhere), errors at the bottom, the
command-line boundary at the top, and a top level that reads like a table of contents."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "bov_jax"
MAX_TOP_LEVEL_MODULES = 12


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def project_modules() -> dict[str, Path]:
    return {module_name(p): p for p in PACKAGE.rglob("*.py")}


def imported_modules(path: Path, known: set[str]) -> set[str]:
    """The project modules `path` imports, at module level or inside functions alike.

    `from bov_jax.x import y` is an import of bov_jax.x.y when that is a module, else of
    bov_jax.x. Package __init__ files are left out: ours hold no imports of the project.
    """
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [
                f"{node.module}.{alias.name}"
                if f"{node.module}.{alias.name}" in known
                else node.module
                for alias in node.names
            ]
        else:
            continue
        found.update(name for name in names if name in known)
    return found


def import_graph() -> dict[str, set[str]]:
    modules = project_modules()
    known = set(modules)
    packages = {name for name, path in modules.items() if path.name == "__init__.py"}
    return {
        name: imported_modules(path, known) - packages - {name} for name, path in modules.items()
    }


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in sorted(graph.get(node, ())):
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_cycle_finder_finds_a_planted_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert cycles(graph) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle_in_the_package():
    graph = import_graph()
    assert len(graph) > 50  # the walk saw the whole package
    assert cycles(graph) == []


def test_errors_sit_at_the_bottom_and_the_boundary_imports_only_them():
    graph = import_graph()
    assert graph["bov_jax.errors"] == set()
    assert graph["bov_jax.cli"] == {"bov_jax.errors"}


def test_only_commands_import_the_cli_boundary():
    """A module that imports bov_jax.cli runs as a command (`python -m`), and no module
    imports a command's `__main__`."""
    modules = project_modules()
    for name, succs in import_graph().items():
        source = modules[name].read_text()
        if "bov_jax.cli" in succs:
            assert modules[name].name == "__main__.py" or '__name__ == "__main__"' in source, name
        assert not any(succ.endswith(".__main__") for succ in succs), name


def test_top_level_holds_at_most_twelve_modules():
    loose = sorted(p.name for p in PACKAGE.glob("*.py") if p.name != "__init__.py")
    assert len(loose) <= MAX_TOP_LEVEL_MODULES, loose
