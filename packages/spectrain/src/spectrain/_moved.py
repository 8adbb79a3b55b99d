"""Module paths of spectrain before its folders by job (one release of grace): importing one gives the
module at its new path, the same object, after a ``DeprecationWarning`` naming the new path.

Nothing inside the packages imports an old path (``tests/test_house.py`` holds that).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings
from typing import Any

MOVED: dict[str, str] = {
    "spectrain.accounting": "spectrain.train.accounting",
    "spectrain.batch": "spectrain.data.batch",
    "spectrain.checkpoint": "spectrain.train.checkpoint",
    "spectrain.distributed": "spectrain.train.distributed",
    "spectrain.draft_io": "spectrain.export.read",
    "spectrain.eval_cli": "spectrain.cli.eval",
    "spectrain.export_cli": "spectrain.cli.export",
    "spectrain.families": "spectrain.models.families",
    "spectrain.loader": "spectrain.data.loader",
    "spectrain.metrics": "spectrain.train.metrics",
    "spectrain.muon": "spectrain.train.muon",
    "spectrain.optim": "spectrain.train.optim",
    "spectrain.plan": "spectrain.train.cost",
    "spectrain.plugins": "spectrain.models.plugins",
    "spectrain.report": "spectrain.eval.report",
    "spectrain.report_cli": "spectrain.cli.report",
    "spectrain.sample_reads": "spectrain.data.sample_reads",
    "spectrain.served": "spectrain.eval.served",
    "spectrain.signals": "spectrain.train.signals",
    "spectrain.speculators_cache": "spectrain.data.speculators_cache",
    "spectrain.speculators_flags": "spectrain.cli.speculators_flags",
    "spectrain.startup": "spectrain.train.startup",
    "spectrain.step": "spectrain.train.step",
    "spectrain.sync_census": "spectrain.train.sync_census",
    "spectrain.trackers": "spectrain.train.trackers",
    "spectrain.train_cli": "spectrain.cli.train",
    "spectrain.train_config": "spectrain.train.config",
    "spectrain.train_setup": "spectrain.train.setup",
    "spectrain.verifier": "spectrain.models.verifier",
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
    """Finds the old module paths of :data:`MOVED` and hands out the module at the new one."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        new = MOVED.get(name)
        if new is None:
            return None
        return importlib.util.spec_from_loader(name, _Alias(new))


def install() -> None:
    """Put :class:`MovedFinder` on ``sys.meta_path`` once."""
    if not any(isinstance(f, MovedFinder) for f in sys.meta_path):
        sys.meta_path.append(MovedFinder())
