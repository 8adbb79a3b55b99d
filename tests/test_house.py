"""House rules of both packages (docs/design.md, "The house"): folders by job with at most 8 modules
beside them, click only under ``*/cli/``, the store's private state read by the store alone, old
module paths only as shims nobody inside imports, no module over 600 lines, no import circle.

The import graph counts every ``import`` in a module, inside functions too, except those under
``if TYPE_CHECKING:`` (type-only): a circle through a lazy import is still a circle a reader has to
untangle, and one edit away from an import-time failure.
"""

from __future__ import annotations

import ast
import inspect
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
    assert (
        "hsgen.generate.pipeline" in graph
        and "spectrain.train.loop" in graph
        and "spectrain.train.checkpoint" in graph
    )
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


MAX_TOP_MODULES = 8


def _imports_of(path: Path) -> set[str]:
    """Every module name ``path`` imports (absolute; functions and TYPE_CHECKING blocks included)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
            names |= {f"{node.module}.{a.name}" for a in node.names}
        elif isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
    return names


def test_each_package_top_level_holds_few_modules():
    for root in ROOTS:
        modules = sorted(p.name for p in root.glob("*.py"))
        assert len(modules) <= MAX_TOP_MODULES, f"{root.name}: {modules} (a folder per job instead)"


def test_click_only_under_cli():
    wrong = sorted(
        name for name, path in _modules().items()
        if ".cli" not in f".{name}" and any(n == "click" or n.startswith("click.") for n in _imports_of(path))
    )  # fmt: skip
    assert wrong == [], f"click outside */cli/: {wrong}"


def _store_private_names() -> set[str]:
    """The private attributes and methods of HiddenStateStore (``self._x`` assigned or ``def _x``)."""
    from hsgen.store.store import HiddenStateStore

    tree = ast.parse(Path(inspect.getsourcefile(HiddenStateStore)).read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "HiddenStateStore")
    names = {n.name for n in cls.body if isinstance(n, ast.FunctionDef) and n.name.startswith("_")}
    for node in ast.walk(cls):
        is_self = (
            isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self"
        )
        if is_self and node.attr.startswith("_") and not node.attr.startswith("__"):
            names.add(node.attr)
    return {n for n in names if not n.startswith("__")}


def test_nobody_reads_the_stores_private_state():
    """Helpers use the written interface (hsgen.store.view.StoreView), not ``store._replay`` and the like."""
    private = _store_private_names()
    assert {"_replay", "_index", "_backend"} <= private
    wrong = []
    for name, path in _modules().items():
        if name == "hsgen.store.store":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Attribute) and node.attr in private
                    and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))
                    and "store" in ast.unparse(node.value).lower()):  # fmt: skip
                wrong.append(f"{name}: {ast.unparse(node)}")
    assert wrong == []


def test_old_module_paths_are_shims_nobody_inside_imports():
    from hsgen._moved import MOVED as HSGEN_MOVED
    from spectrain._moved import MOVED as SPECTRAIN_MOVED

    moved = {**HSGEN_MOVED, **SPECTRAIN_MOVED}
    modules = _modules()
    assert not set(moved) & set(modules), "an old path is a module again"
    assert set(moved.values()) <= set(modules)
    wrong = {name: sorted(n for n in _imports_of(path) if n in moved) for name, path in modules.items()}
    assert {k: v for k, v in wrong.items() if v} == {}


def test_an_old_path_imports_the_same_module_with_a_warning():
    import importlib
    import sys
    import warnings

    import hsgen.client.config as new

    sys.modules.pop("hsgen.client_types", None)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        old = importlib.import_module("hsgen.client_types")
    assert old is new and new.__spec__.name == "hsgen.client.config"
    assert any(
        issubclass(w.category, DeprecationWarning) and "hsgen.client.config" in str(w.message) for w in seen
    )


def test_package_faces_keep_the_old_modules_names():
    import hsgen.client
    import hsgen.protocol
    import spectrain.data
    import spectrain.train
    from hsgen.client.fetch import HiddenStateClient
    from spectrain.train.loop import train

    assert hsgen.client.HiddenStateClient is HiddenStateClient and spectrain.train.train is train
    assert callable(hsgen.protocol.parse_layer_ids) and spectrain.data.Batch.__name__ == "Batch"


def test_eval_does_not_import_the_reference_server():
    graph = import_graph()
    wrong = {m: sorted(d for d in deps if d.startswith("hsgen.serve")) for m, deps in graph.items()
             if m == "spectrain.eval" or m.startswith("spectrain.eval.")}  # fmt: skip
    assert {m: d for m, d in wrong.items() if d} == {}


def test_models_do_not_import_data_loading():
    """A draft sees one packed Batch; the loader, sources and store are not its business."""
    graph = import_graph()
    wrong = {
        m: sorted(d for d in deps if d.startswith(("spectrain.data", "hsgen.store")) and d != "spectrain.data.batch")
        for m, deps in graph.items() if m.startswith("spectrain.models")
    }  # fmt: skip
    assert {m: d for m, d in wrong.items() if d} == {}


def test_tests_mirror_the_package_folders():
    tests = Path(__file__).parent
    for root in ROOTS:
        folders = {p.parent.name for p in (tests / root.name).glob("*/test_*.py")}
        jobs = {p.name for p in root.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
        assert folders <= jobs, (
            f"tests/{root.name}/ has folders that are no job of {root.name}: {folders - jobs}"
        )
