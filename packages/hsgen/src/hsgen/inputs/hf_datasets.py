"""Datasets as inputs: a Hugging Face hub dataset id or a local dataset directory.

Beside JSONL/JSON/Parquet files, every command that reads prompts accepts:

- a directory written by ``datasets`` (``Dataset.save_to_disk`` / ``DatasetDict.save_to_disk``),
  read with ``datasets.load_from_disk`` (memory-mapped Arrow, no copy);
- a directory of data files as a dataset repository holds them (``data/train-*.parquet``, ...),
  read with ``datasets.load_dataset(dir, streaming=True)`` (read as consumed, no Arrow copy);
- a hub dataset id such as ``HuggingFaceH4/ultrachat_200k``: its files are taken from the
  Hugging Face cache first (``HF_HUB_OFFLINE``, ``HF_HOME`` honoured; see :mod:`hsgen.hf.hub`),
  downloaded into it otherwise, then read as above. With ``streaming`` (and online) the rows
  are streamed from the hub as they are consumed, nothing downloaded ahead.

Rows are the same records as a file's lines (``messages``, ``conversations``, ``input_ids``,
``prompt``); a record's source reads ``NAME[SPLIT]:row N``. ``datasets`` imports no torch.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DATASETS_HINT = "pip install datasets"


class DatasetInputError(ValueError):
    """A dataset that cannot be found, loaded or has no such split."""


@dataclass(frozen=True)
class DatasetSpec:
    """One dataset input and how to read it.

    Attributes:
        name: a local dataset directory or a hub dataset id (``org/name``).
        split: the split to read (``train``, ``test``, ``train_sft``, ...).
        max_samples: read at most this many rows (None: all).
        streaming: stream a hub dataset's rows instead of downloading its files first.
        config: the dataset's configuration (subset) name, if it has several.
        revision: branch, tag or commit of a hub dataset.
    """

    name: str
    split: str = "train"
    max_samples: int | None = None
    streaming: bool = False
    config: str | None = None
    revision: str | None = None

    def __str__(self) -> str:
        return f"{self.name}[{self.split}]"


def is_saved_dataset(path: Path) -> bool:
    """A directory written by ``save_to_disk`` (one dataset, or a dict of splits)."""
    return (path / "dataset_dict.json").is_file() or (
        (path / "state.json").is_file() and (path / "dataset_info.json").is_file()
    )


def is_dataset_input(name: str) -> bool:
    """Whether a plain input string names a dataset rather than a file: a directory, or (when no
    such path exists) a hub id like ``org/name``."""
    from hsgen.hf.hub import looks_like_hub_id

    p = Path(name)
    if p.is_dir():
        return True
    return not p.exists() and "/" in name and not p.suffix and looks_like_hub_id(name)


def _datasets():
    try:
        import datasets
    except ImportError:
        raise DatasetInputError(
            f"reading a dataset directory or hub id needs the datasets library: {DATASETS_HINT}"
        ) from None
    datasets.logging.set_verbosity_error()
    datasets.disable_progress_bars()
    return datasets


def _hub_snapshot(spec: DatasetSpec) -> Path:
    """The dataset repository's files in the hub cache (cache first, then download unless offline)."""
    import huggingface_hub
    from huggingface_hub.errors import LocalEntryNotFoundError

    from hsgen.hf.hub import cache_dir, offline

    kw = {"repo_type": "dataset", "revision": spec.revision, "cache_dir": cache_dir()}
    try:
        return Path(huggingface_hub.snapshot_download(spec.name, local_files_only=True, **kw))
    except LocalEntryNotFoundError:
        if offline():
            raise DatasetInputError(
                f"{spec.name}: dataset not in the Hugging Face cache {cache_dir()} and HF_HUB_OFFLINE is set"
            ) from None
    try:
        return Path(huggingface_hub.snapshot_download(spec.name, **kw))
    except Exception as e:  # repository missing, no access, network: one line naming the dataset
        raise DatasetInputError(
            f"{spec.name}: cannot download the dataset ({type(e).__name__}: {e})"
        ) from None


def _load(spec: DatasetSpec) -> Any:
    ds_lib = _datasets()
    path = Path(spec.name).expanduser()
    try:
        if path.is_dir() and is_saved_dataset(path):
            ds = ds_lib.load_from_disk(str(path))
            if isinstance(ds, ds_lib.DatasetDict):
                if spec.split not in ds:
                    raise DatasetInputError(f"{spec.name}: no split {spec.split!r} (splits: {sorted(ds)})")
                ds = ds[spec.split]
            return ds
        from hsgen.hf.hub import offline

        if path.is_dir():
            source = str(path)
        elif spec.streaming and not offline():
            source = spec.name  # rows come from the hub as consumed
        else:
            source = str(_hub_snapshot(spec))
        kw = {"revision": spec.revision} if source == spec.name and spec.revision else {}
        return ds_lib.load_dataset(source, spec.config, split=spec.split, streaming=True, **kw)
    except DatasetInputError:
        raise
    except ValueError as e:  # datasets reports an unknown split or config as ValueError
        raise DatasetInputError(f"{spec}: {e}") from None
    except (OSError, ds_lib.exceptions.DatasetNotFoundError) as e:
        raise DatasetInputError(f"{spec}: cannot load ({e})") from None


def iter_dataset_records(spec: DatasetSpec) -> Iterator[tuple[str, Any]]:
    """Yield ``(source, record)`` for the rows of ``spec`` (at most ``max_samples``)."""
    ds = _load(spec)
    if spec.max_samples is not None:
        ds = (
            ds.take(spec.max_samples)
            if hasattr(ds, "take")
            else ds.select(range(min(spec.max_samples, len(ds))))
        )
    label = os.path.normpath(spec.name) if Path(spec.name).exists() else spec.name
    for i, row in enumerate(ds):
        yield f"{label}[{spec.split}]:row {i}", _drop_nulls(row)


def _drop_nulls(value: Any) -> Any:
    """Arrow gives every struct all the fields of its column: a message without ``tool_calls``
    comes back with ``tool_calls: None``. Drop those so the record reads as the original."""
    if isinstance(value, dict):
        return {k: _drop_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_drop_nulls(v) for v in value]
    return value


def as_input(
    name: str | DatasetSpec, *, split: str = "train", max_samples: int | None = None, streaming: bool = False
) -> str | DatasetSpec:
    """``name`` as a :class:`DatasetSpec` with these options when it names a dataset, else as is."""
    if isinstance(name, DatasetSpec) or name == "-" or not is_dataset_input(str(name)):
        return name
    return DatasetSpec(str(name), split=split, max_samples=max_samples, streaming=streaming)
