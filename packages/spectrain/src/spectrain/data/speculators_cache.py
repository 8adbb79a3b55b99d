"""A speculators hidden-state cache as a run's data: ``spectrain train --hidden-states-path DIR``.

speculators' ``data_generation_offline.py`` writes one vLLM file per row of its prepared dataset,
``DIR/hs_<row>.safetensors``, and its ``train.py --hidden-states-path DIR`` trains from them
(``DIR`` defaults to ``<data-path>/hidden_states``). Here the first run imports the cache into a
store next to it, ``DIR.store`` (or ``--store``), with :func:`hsgen.generate.speculators_import.import_cache`
(each file read once, checked, checksummed); later runs reuse that store, import only files added
since and refuse one that changed (:class:`~hsgen.generate.speculators_import.StaleCache`) or a store
holding samples of another dataset. The run then reads the store like any other, with every check a
store read gets. Processes of one ``torchrun`` job import under one file lock, one after another:
the first imports, the others find everything stored.

``--on-missing`` is speculators': a row without a file is generated from vLLM (``generate``, an
online run over the store), dropped silently (``skip``), dropped with a warning (``warn``), or
stops the run (``raise``, the default offline) before its first step, where speculators would
stop at the first such row. A file that cannot be used (truncated, other tokens than its row,
NaN) is a missing row under ``raise`` and ``generate``; under ``skip``/``warn`` it is data lost,
counted in the run's ``samples_refused`` (exit 3 unless ``--accept-refused`` covers it).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

ON_MISSING = ("generate", "skip", "warn", "raise")
STORE_SUFFIX = ".store"


def store_for(hs_dir: str | Path) -> Path:
    """Where the cache at ``hs_dir`` is imported unless ``--store`` says: ``<hs_dir>.store`` beside it."""
    hs_dir = Path(hs_dir)
    return hs_dir.with_name(hs_dir.name + STORE_SUFFIX)


def holds_cache(hs_dir: str | Path) -> bool:
    from hsgen.generate.speculators_import import cache_files

    return Path(hs_dir).is_dir() and bool(cache_files(Path(hs_dir)))


def is_store(path: str | Path) -> bool:
    """``path`` is an hsgen store (what ``hsgen generate-offline-data --output`` writes)."""
    from hsgen.store.store import HEADER_FILE

    return (Path(path) / HEADER_FILE).is_file()


def resolve_flags(data: dict[str, Any]) -> None:
    """``--hidden-states-path`` (or a ``hidden_states/`` cache or store inside a ``--data-path``
    directory, as speculators reads it) in a TrainConfig dict. Online, the servers write into an
    explicit ``--hidden-states-path`` that is a cache, not a store (speculators' launch_vllm.py)."""
    given = data.get("hidden_states_path")
    if given and data.get("online") and not is_store(given):
        data["online_options"] = {"shared_dir": str(given), **(data.get("online_options") or {})}
    prompts = data.get("prompts")
    found = Path(prompts) / "hidden_states" if prompts else None
    if not given and found and not data.get("store") and (holds_cache(found) or is_store(found)):
        data["hidden_states_path"] = str(found)
        log.info("%s: %s: training from it (--hidden-states-path)", found,
                 "an hsgen store" if is_store(found) else "a speculators hidden-state cache")  # fmt: skip


def _store_rows(cfg, store: Path) -> tuple[Any, list[int]]:
    """The dataset's rows (None when there is no prepared dataset to compare with) and the rows the
    store lacks."""
    from hsgen.generate.speculators_import import dataset_rows
    from hsgen.store import HiddenStateStore

    st = HiddenStateStore.open(store)
    data = data_dir(cfg)
    if not cfg.prompts and not (data / "dataset_info.json").is_file():
        return None, []
    rows = dataset_rows(data)
    stored = set(st.sample_ids())
    return rows, [i for i, sid in enumerate(rows.ids) if sid not in stored]


def _use_store(cfg, store: Path, *, plan_only: bool = False) -> dict[str, Any]:
    """``--hidden-states-path STORE``: trained from as ``--store``; ``--on-missing`` applies to the
    rows of the prepared dataset the store lacks."""
    if cfg.store and Path(cfg.store).resolve() != store.resolve():
        raise ValueError(f"--hidden-states-path {store} is a store and --store {cfg.store} another: give one")
    rows, missing = _store_rows(cfg, store)
    n = len(rows.ids) if rows is not None else 0
    policy = on_missing(cfg)
    if missing and policy == "raise":
        raise ValueError(f"{data_dir(cfg)}: no hidden states in {store} for {_rows_line(missing, n)}; --on-missing "
                         "raise: generate them (hsgen generate-offline-data), or --on-missing warn / skip to train "
                         "without them")  # fmt: skip
    if missing and policy == "warn" and not plan_only and os.environ.get("RANK", "0") == "0":
        log.warning("%s: no hidden states in %s for %s: trained without them (--on-missing warn)", data_dir(cfg),
                    store, _rows_line(missing, n))  # fmt: skip
    cfg.store = str(store)
    return {"hidden_states_path": str(store), "store": str(store), "rows": n, "imported": 0,
            "already_stored": n - len(missing), "skipped": 0, "rows_without_file": len(missing)}  # fmt: skip


def data_dir(cfg) -> Path:
    """The prepared dataset the cache's rows belong to: ``--data-path``, else the cache's parent."""
    return Path(cfg.prompts) if cfg.prompts else Path(cfg.hidden_states_path).resolve().parent


def on_missing(cfg) -> str:
    return cfg.on_missing or ("generate" if cfg.online else "raise")


def _num_layers(verifier: str) -> int:
    cfg = json.loads((Path(verifier) / "config.json").read_text())
    return int(cfg.get("text_config", cfg)["num_hidden_layers"])


def layer_ids(cfg) -> list[int]:
    """The layer ids the cache's files hold: ``--target-layer-ids`` plus the last layer, as
    speculators' ``launch_vllm.py`` extracts them (its default ``2, n//2, n-3`` and ``n`` without)."""
    from hsgen.generate.speculators_import import speculators_layer_ids

    n = _num_layers(cfg.verifier)
    aux = cfg.draft.get("aux_layer_ids")
    if aux:
        return [*(int(i) for i in aux if int(i) != n), n]
    return speculators_layer_ids(n)


def _file_layers(path: Path) -> int:
    from hsgen.protocol import extraction as protocol

    with open(path, "rb") as f:
        tensors = protocol.read_safetensors_header(f, os.fstat(f.fileno()).st_size)
    return int(tensors[protocol.HIDDEN_STATES_KEY].shape[1])


def _check_layers(cfg, ids: list[int], hs_dir: Path) -> None:
    from hsgen.generate.speculators_import import cache_files

    files = cache_files(hs_dir)
    if not files:
        return
    first = files[min(files)]
    try:
        held = _file_layers(first)
    except (OSError, ValueError, KeyError):
        return  # an unreadable file is named by the import itself
    if held != len(ids):
        raise ValueError(f"{first}: holds {held} layers, but --target-layer-ids give {ids} (with the last layer): "
                         "pass the --target-layer-ids vLLM was launched with")  # fmt: skip


@contextlib.contextmanager
def _import_lock(store: Path):
    """One importer at a time (the ranks of a torchrun job, or two runs on one cache)."""
    store.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(store.parent / f".{store.name}.lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _check_room(store: Path, hs_dir: Path, data: Path) -> None:
    """Refuse an import the store's disk cannot hold (the files not imported yet, by size)."""
    from hsgen.generate.speculators_import import cache_files, read_record

    seen = set(read_record(store).get("files", {}))
    need = sum(p.stat().st_size for p in cache_files(hs_dir).values() if p.name not in seen)
    if not need:
        return
    free = shutil.disk_usage(store.parent).free
    if need > free:
        gib = 2**30
        raise ValueError(f"{store}: importing the cache {hs_dir} needs {need / gib:.1f} GiB, {free / gib:.1f} GiB "
                         "are free there: pass --store DIR on a disk with room")  # fmt: skip


def _rows_line(rows: Sequence[int], total: int) -> str:
    shown = ", ".join(map(str, rows[:5])) + (", ..." if len(rows) > 5 else "")
    return f"{len(rows)} of its {total} rows (rows {shown})"


def prepare(cfg) -> dict[str, Any]:
    """Import (or reuse) the store of ``cfg.hidden_states_path``; sets ``cfg.store`` (and, online, the
    servers' ``shared_dir`` when not given). Returns the import's summary; raises ``ValueError``
    (one line) for what ``--on-missing raise`` refuses, a stale cache or a foreign store."""
    from hsgen.generate.speculators_import import ImportError_, import_cache

    hs_dir = Path(cfg.hidden_states_path)
    if is_store(hs_dir):
        return _use_store(cfg, hs_dir)
    data = data_dir(cfg)
    store = Path(cfg.store) if cfg.store else store_for(hs_dir)
    policy = on_missing(cfg)
    if not hs_dir.is_dir():
        if policy == "generate":  # an online run before any file exists: nothing to import
            return {"hidden_states_path": str(hs_dir), "store": None}
        raise ValueError(f"--hidden-states-path {hs_dir}: no such directory")
    ids = layer_ids(cfg)
    _check_layers(cfg, ids, hs_dir)
    main = os.environ.get("RANK", "0") == "0"
    with _import_lock(store):
        _check_room(store, hs_dir, data)
        try:
            result = import_cache(data, store, verifier=cfg.verifier, layer_ids=ids, hidden_states_path=hs_dir,
                                  chat_template=cfg.chat_template, progress=False if not main else None)  # fmt: skip
        except ImportError_ as e:
            raise ValueError(str(e)) from None
    if result.foreign:
        raise ValueError(f"{store}: holds {result.foreign} samples of no row of {data} (the dataset was prepared "
                         "anew since the import): remove the store, or pass --store NEW")  # fmt: skip
    summary = {"hidden_states_path": str(hs_dir), "store": str(store) if result.store_exists else None,
               "rows": result.rows, **result.summary()}  # fmt: skip
    if main:
        log.info("speculators cache %s -> store %s: %d imported, %d already stored, %d rows without a file, "
                 "%d files refused", hs_dir, store, result.imported, result.already, result.missing_rows,
                 len(result.skipped))  # fmt: skip
    lost = [*result.skipped]
    if policy == "raise" and (result.missing or lost):
        what = f"{hs_dir}: " + (f"no hidden-state file for {_rows_line(result.missing, result.rows)}"
                                if result.missing else f"{len(lost)} files cannot be used ({lost[0]})")  # fmt: skip
        raise ValueError(f"{what}; --on-missing raise: generate them (hsgen generate-offline-data), or "
                         "--on-missing warn / skip to train without them")  # fmt: skip
    if main:
        for line in lost:
            log.warning("%s/%s: refused, not trained on", hs_dir, line)
        if result.missing and policy == "warn":
            log.warning("%s: no hidden-state file for %s: trained without them (--on-missing warn)", hs_dir,
                        _rows_line(result.missing, result.rows))  # fmt: skip
    if policy in ("skip", "warn"):
        summary["samples_refused"] = len(lost)
    if result.store_exists:
        cfg.store = str(store)
    elif not cfg.online:
        raise ValueError(f"{hs_dir}: no file of the cache could be imported: nothing to train on")
    return summary


@dataclass
class CacheView:
    """What a run over the cache would train on, without importing anything (``--dry-run``)."""

    ids: list[str]
    length_of: dict[str, int]
    layer_ids: list[int]
    val_fraction: float
    seed: int
    summary: dict[str, Any]

    def plan(self, epoch: int) -> list[str]:
        from spectrain.data.sources import epoch_plan, split_of

        return epoch_plan(
            [i for i in self.ids if split_of(i, self.val_fraction) == "train"], epoch, self.seed
        )

    def lengths(self, sample_ids: Sequence[str]) -> list[int]:
        return [self.length_of[i] for i in sample_ids]


def view(cfg) -> CacheView:
    """The samples a run over ``cfg.hidden_states_path`` would have (stored, or with a file), and the
    layer ids; refuses what :func:`prepare` refuses without reading a file's payload."""
    from hsgen.generate.speculators_import import cache_files, dataset_rows, read_record
    from hsgen.store import HiddenStateStore
    from hsgen.store.store import HEADER_FILE

    hs_dir = Path(cfg.hidden_states_path)
    if is_store(hs_dir):
        return _store_view(cfg, hs_dir)
    store = Path(cfg.store) if cfg.store else store_for(hs_dir)
    if not hs_dir.is_dir():
        raise ValueError(f"--hidden-states-path {hs_dir}: no such directory")
    rows = dataset_rows(data_dir(cfg), read_record(store))
    files = cache_files(hs_dir)
    stored, ids = set(), layer_ids(cfg)
    if (store / HEADER_FILE).exists():
        st = HiddenStateStore.open(store)
        stored, ids = set(st.sample_ids()), list(st.header.layer_ids)
    else:
        _check_layers(cfg, ids, hs_dir)
    have = [i for i, sid in enumerate(rows.ids) if sid in stored or i in files]
    missing = [i for i in range(len(rows.ids)) if i not in set(have)]
    if missing and on_missing(cfg) == "raise":
        raise ValueError(f"{hs_dir}: no hidden-state file for {_rows_line(missing, len(rows.ids))}; --on-missing "
                         "raise: generate them (hsgen generate-offline-data), or --on-missing warn / skip to train "
                         "without them")  # fmt: skip
    summary = {"hidden_states_path": str(hs_dir), "store": str(store), "rows": len(rows.ids),
               "stored": len(stored), "to_import": sum(1 for i in have if rows.ids[i] not in stored),
               "rows_without_file": len(missing)}  # fmt: skip
    return CacheView([rows.ids[i] for i in have], {rows.ids[i]: rows.lengths[i] for i in have}, ids,
                     cfg.val_fraction, cfg.seed, summary)  # fmt: skip


class _StoreView(CacheView):
    """A store given as ``--hidden-states-path``, planned from its manifest like ``--store``."""

    def __init__(self, source, layer_ids: list[int], summary: dict[str, Any]):
        self.source, self.layer_ids, self.summary = source, layer_ids, summary

    def plan(self, epoch: int) -> list[str]:
        return self.source.plan(epoch)

    def lengths(self, sample_ids: Sequence[str]) -> list[int]:
        return self.source.lengths(sample_ids)


def _store_view(cfg, store: Path) -> CacheView:
    from spectrain.data.sources import StoreSource

    summary = _use_store(cfg, store, plan_only=True)
    source = StoreSource(
        str(store), split="train", val_fraction=cfg.val_fraction, seed=cfg.seed, verify=False
    )
    return _StoreView(source, list(source.header.layer_ids), summary)
