"""Module paths of spectrain before its folders by job (one release of grace): importing one gives the
module at its new path, the same object, after a ``DeprecationWarning`` naming the new path.

Nothing inside the packages imports an old path (``tests/test_house.py`` holds that).
"""

from __future__ import annotations

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


def install() -> None:
    """Put a finder of :data:`MOVED` on ``sys.meta_path`` once (hsgen's machinery)."""
    from hsgen import _moved

    _moved.install(MOVED)
