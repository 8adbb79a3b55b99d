"""Module paths of hsgen before its folders by job (one release of grace): importing one gives the
module at its new path, the same object, after a ``DeprecationWarning`` naming the new path.

Nothing inside the packages imports an old path (``tests/test_house.py`` holds that).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings
from collections.abc import Callable
from typing import Any

MOVED: dict[str, str] = {
    "hsgen.breaker": "hsgen.client.breaker",
    "hsgen.cli_options": "hsgen.cli.render_options",
    "hsgen.client_types": "hsgen.client.config",
    "hsgen.errors": "hsgen.client.errors",
    "hsgen.generate_cli": "hsgen.cli.generate",
    "hsgen.generate_options": "hsgen.cli.generate_options",
    "hsgen.head_tensors": "hsgen.hf.head_tensors",
    "hsgen.hf_datasets": "hsgen.inputs.hf_datasets",
    "hsgen.hidden_file": "hsgen.client.hidden_file",
    "hsgen.hub": "hsgen.hf.hub",
    "hsgen.input_count": "hsgen.inputs.count",
    "hsgen.launcher": "hsgen.generate.launcher",
    "hsgen.phases": "hsgen.client.phases",
    "hsgen.prompt_filter": "hsgen.generate.prompt_filter",
    "hsgen.prompt_logprobs": "hsgen.protocol.prompt_logprobs",
    "hsgen.render": "hsgen.inputs.render",
    "hsgen.render_cli": "hsgen.cli.render",
    "hsgen.render_server": "hsgen.inputs.render_server",
    "hsgen.retry": "hsgen.client.retry",
    "hsgen.run_report": "hsgen.generate.report",
    "hsgen.sample_data": "hsgen.inputs.sample_data",
    "hsgen.saturate": "hsgen.client.saturate",
    "hsgen.serve.cli": "hsgen.cli.serve",
    "hsgen.shared_dir": "hsgen.client.shared_dir",
    "hsgen.speculators_import": "hsgen.generate.speculators_import",
    "hsgen.speculators_import_cli": "hsgen.cli.import_speculators",
    "hsgen.speculators_scripts": "hsgen.cli.speculators_scripts",
    "hsgen.store.cli": "hsgen.cli.store",
    "hsgen.store.inspect_cli": "hsgen.cli.inspect",
    "hsgen.store_shape": "hsgen.generate.store_shape",
    "hsgen.store_sink": "hsgen.generate.sink",
    "hsgen.tiny": "hsgen.hf.tiny",
    "hsgen.tokenizer_check": "hsgen.client.tokenizer_check",
    "hsgen.vllm_command": "hsgen.vllm.command",
    "hsgen.vllm_server": "hsgen.vllm.server",
    "hsgen.wait_cli": "hsgen.cli.wait",
}


class _Alias(importlib.abc.Loader):
    """Loads an old path as the module at its new one (its own ``__spec__`` kept)."""

    def __init__(self, new: str) -> None:
        self.new = new
        self.spec: Any = None

    def create_module(self, spec: Any) -> Any:
        warnings.warn(f"{spec.name} moved to {self.new}; the old path goes in the next release",
                      DeprecationWarning, stacklevel=2)  # fmt: skip
        module = importlib.import_module(self.new)
        self.spec = module.__spec__
        return module

    def exec_module(self, module: Any) -> None:
        module.__spec__ = self.spec


class MovedFinder(importlib.abc.MetaPathFinder):
    """Finds the old module paths of a table (old -> new) and hands out the module at the new one."""

    def __init__(self, table: dict[str, str]) -> None:
        self.table = table

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        new = self.table.get(name)
        if new is None:
            return None
        return importlib.util.spec_from_loader(name, _Alias(new))


def forward(target: str, names: list[str]) -> Callable[[str], Any]:
    """A package face's ``__getattr__`` (PEP 562): each of ``names`` taken from module ``target`` on
    first use, so a folder still offers the names of the module it was without importing it."""

    def __getattr__(name: str) -> Any:
        if name in names:
            return getattr(importlib.import_module(target), name)
        raise AttributeError(f"module {target.rsplit('.', 1)[0]!r} has no attribute {name!r}")

    return __getattr__


def install(table: dict[str, str] | None = None) -> None:
    """Put a :class:`MovedFinder` of ``table`` (default: hsgen's :data:`MOVED`) on ``sys.meta_path``
    once (spectrain installs its own table through this)."""
    table = MOVED if table is None else table
    if not any(isinstance(f, MovedFinder) and f.table is table for f in sys.meta_path):
        sys.meta_path.append(MovedFinder(table))
