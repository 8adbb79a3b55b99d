"""House rules of both packages: no module over 600 lines, no import circle.

The import graph counts every ``import`` in a module, inside functions too, except those under
``if TYPE_CHECKING:`` (type-only): a circle through a lazy import is still a circle a reader has to
untangle, and one edit away from an import-time failure.
"""

from __future__ import annotations

import ast
from pathlib import Path

import hsgen
import spectrain

ROOTS = [Path(hsgen.__file__).parent, Path(spectrain.__file__).parent]
MAX_LINES = 600


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p, root): p for root in ROOTS for p in root.rglob("*.py")}


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip |= {id(n) for n in ast.walk(node)}
    return skip


def import_graph() -> dict[str, set[str]]:
    """Module -> modules of both packages it imports anywhere (functions included, TYPE_CHECKING blocks not)."""
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text())
        skip = _type_checking_nodes(tree)
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        deps: set[str] = set()
        for node in ast.walk(tree):
            if id(node) in skip:
                continue
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package[: len(package) - (node.level - 1)]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                for alias in node.names:
                    sub = f"{target}.{alias.name}"
                    deps.add(sub if sub in modules else target)
            elif isinstance(node, ast.Import):
                deps |= {a.name for a in node.names}
        graph[name] = {d for d in deps if d in modules and d != name}
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    cycles: list[list[str]] = []
    state: dict[str, int] = {}

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == 1:
                cycles.append([*stack[stack.index(dep) :], dep])
            elif dep not in state:
                visit(dep, [*stack, dep])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    return cycles


def test_no_import_cycle():
    graph = import_graph()
    assert "hsgen.generate" in graph and "spectrain.train" in graph and "spectrain.checkpoint" in graph
    assert find_cycles(graph) == []


def test_hsgen_never_imports_spectrain():
    """The data side stands alone: hsgen is installed and used without the trainer."""
    graph = import_graph()
    wrong = {
        m: sorted(d for d in deps if d.startswith("spectrain"))
        for m, deps in graph.items()
        if m.startswith("hsgen")
    }
    assert {m: d for m, d in wrong.items() if d} == {}


def test_cycle_finder_sees_a_cycle():
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c", "a"]]


def test_no_module_over_600_lines():
    long = {
        name: n for name, path in _modules().items() if (n := len(path.read_text().splitlines())) > MAX_LINES
    }
    assert long == {}, f"split these modules (at most {MAX_LINES} lines each): {long}"
