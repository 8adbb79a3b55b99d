"""Experiment trackers a run reports its metrics records to: ``--report-to tensorboard,wandb,trackio``.

Each tracker receives every ``metrics.jsonl`` record (training, validation, and the online data
counters of ``data``) flattened to ``<split>/<name>`` scalars at the record's step:
``train/loss``, ``train/acc_1``, ``validation/tau``, ``train/data/samples_generated``, ...
The packages are imported only when asked for; a missing one is a one-line error with the
``pip install`` that fixes it. Trackers run on rank 0 only.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

TRACKERS = ("tensorboard", "wandb", "trackio")
PROJECT_ENV = {"wandb": "WANDB_PROJECT", "trackio": "TRACKIO_PROJECT"}
DEFAULT_PROJECT = "spectrain"


def parse_report_to(values: Any) -> list[str]:
    """``"wandb,tensorboard"``, a list of such strings, or None -> checked, de-duplicated names."""
    if not values:
        return []
    if isinstance(values, str):
        values = [values]
    names: list[str] = []
    for v in values:
        for name in str(v).replace(" ", ",").split(","):
            name = name.strip().lower()
            if not name or name == "none" or name in names:
                continue
            if name not in TRACKERS:
                raise ValueError(f"report_to: unknown tracker {name!r}; choose from {', '.join(TRACKERS)}")
            names.append(name)
    return names


def flatten(record: dict[str, Any]) -> dict[str, float]:
    """Scalars of a metrics record under ``<split>/``; lists become ``name_1..``, dicts ``name/key``."""
    prefix = record.get("split", "train")
    out: dict[str, float] = {}

    def add(key: str, v: Any) -> None:
        if isinstance(v, int | float):  # bool included
            out[key] = float(v)
        elif isinstance(v, list):
            for i, x in enumerate(v):
                if isinstance(x, int | float) and not isinstance(x, bool):
                    out[f"{key}_{i + 1}"] = float(x)
        elif isinstance(v, dict):
            for k, x in v.items():
                add(f"{key}/{k}", x)

    for k, v in record.items():
        if k not in ("step", "split"):
            add(f"{prefix}/{k}", v)
    return out


def _need(module: str, pip: str):
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise RuntimeError(f"--report-to {pip} needs the {pip} package: pip install {pip}") from None


class TensorBoardTracker:
    """``<save_path>/tensorboard`` event files (torch's SummaryWriter); with a ``run_name``, in
    ``<save_path>/tensorboard/<run_name>``, the run TensorBoard lists under that name."""

    def __init__(self, save_path: Path, run_name: str, config: dict[str, Any]):
        _need("tensorboard", "tensorboard")
        from torch.utils.tensorboard import SummaryWriter

        logdir = save_path / "tensorboard"
        self.writer = SummaryWriter(str(logdir / run_name if config.get("run_name") else logdir))

    def log(self, scalars: dict[str, float], step: int) -> None:
        for k, v in scalars.items():
            self.writer.add_scalar(k, v, step)

    def close(self) -> None:
        self.writer.close()


class WandbTracker:
    """A Weights & Biases run (project ``$WANDB_PROJECT`` or ``spectrain``, named ``run_name``)."""

    def __init__(self, save_path: Path, run_name: str, config: dict[str, Any]):
        wandb = _need("wandb", "wandb")
        project = os.environ.get(PROJECT_ENV["wandb"], DEFAULT_PROJECT)
        self.run = wandb.init(
            project=project, name=run_name, config=config, dir=str(save_path), resume="allow"
        )

    def log(self, scalars: dict[str, float], step: int) -> None:
        self.run.log(scalars, step=step)

    def close(self) -> None:
        self.run.finish()


class TrackioTracker:
    """A trackio run (local-first; project ``$TRACKIO_PROJECT`` or ``spectrain``)."""

    def __init__(self, save_path: Path, run_name: str, config: dict[str, Any]):
        self.trackio = _need("trackio", "trackio")
        project = os.environ.get(PROJECT_ENV["trackio"], DEFAULT_PROJECT)
        self.trackio.init(project=project, name=run_name, config=config, resume="allow")

    def log(self, scalars: dict[str, float], step: int) -> None:
        self.trackio.log(scalars, step=step)

    def close(self) -> None:
        self.trackio.finish()


_CLASSES = {"tensorboard": TensorBoardTracker, "wandb": WandbTracker, "trackio": TrackioTracker}


def run_name(config: dict[str, Any] | None, save_path: str | Path) -> str:
    """The run's name: ``run_name`` with speculators' placeholders filled in (``{time}``,
    ``{utc_time}``: now, ISO to the second; ``{rank}``, ``{local_rank}``: from the environment),
    or ``save_path``'s last directory."""
    from datetime import UTC, datetime

    name = (config or {}).get("run_name")
    if not name:
        return Path(save_path).resolve().name
    values = {"{time}": datetime.now().isoformat(timespec="seconds"),
              "{utc_time}": datetime.now(UTC).isoformat(timespec="seconds"),
              "{rank}": os.environ.get("RANK", "0"), "{local_rank}": os.environ.get("LOCAL_RANK", "0")}  # fmt: skip
    for key, value in values.items():
        name = name.replace(key, value)
    return name


class Trackers:
    """The trackers of one run; ``log(record)`` forwards a metrics record to each."""

    def __init__(self, names: list[str], save_path: Path, config: dict[str, Any] | None = None):
        name = run_name(config, save_path)
        self.trackers = [_CLASSES[n](Path(save_path), name, dict(config or {})) for n in names]

    def log(self, record: dict[str, Any]) -> None:
        if not self.trackers:
            return
        scalars = flatten(record)
        for t in self.trackers:
            t.log(scalars, int(record["step"]))

    def close(self) -> None:
        for t in self.trackers:
            t.close()
        self.trackers = []
