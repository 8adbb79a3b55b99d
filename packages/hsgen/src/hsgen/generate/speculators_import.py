"""``hsgen import-speculators``: a hidden-state cache speculators wrote, as a store.

speculators' ``prepare-data`` saves a ``datasets`` directory (``input_ids``, ``loss_mask``,
``seq_len`` per row) and its ``generate-offline-data`` moves each of vLLM's hidden-state files
to ``<data-path>/hidden_states/hs_<row>.safetensors``: vLLM's own file (``hidden_states``
``[T, layers, H]``, ``token_ids`` ``[T]``), the layers being the ids vLLM was launched with.
The import reads each file once (the same checked reader as the online path), pairs it with its
row's loss mask, checks that the token ids agree, and adds it to a store under the id ``hsgen
generate`` gives the same pre-tokenized prompt, so the imported samples and any generated later
are one set. A second run adds only what is missing; a file that cannot be read or disagrees with
its row is named and skipped, and the command then exits non-zero.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

log = logging.getLogger(__name__)

FILE_RE = re.compile(r"^hs_(\d+)\.safetensors$")


class ImportError_(ValueError):
    """The cache cannot be imported at all (one line naming the path or flag)."""


class StaleCache(ImportError_):
    """The cache changed since it was imported: a file now holds other states than the stored sample."""


RECORD_FILE = ".speculators-import.json"
"""Inside the store: the dataset's fingerprint, its rows' sample ids and lengths, and the size and
mtime of each cache file seen, so a later run reuses the store without reading the dataset again
and notices a file that changed."""


@dataclass
class ImportResult:
    imported: int = 0
    already: int = 0
    skipped: list[str] = field(default_factory=list)
    """``file: reason`` of each file left out."""
    missing: list[int] = field(default_factory=list)
    """Dataset rows neither stored nor with a hidden-state file (not generated yet)."""
    rows: int = 0
    foreign: int = 0
    """Stored samples that are no row of the dataset (another dataset imported into the same store)."""
    store_exists: bool = False

    @property
    def missing_rows(self) -> int:
        return len(self.missing)

    def summary(self) -> dict:
        return {"imported": self.imported, "already_stored": self.already, "skipped": len(self.skipped),
                "rows_without_file": len(self.missing)}  # fmt: skip


def speculators_layer_ids(num_hidden_layers: int) -> list[int]:
    """The layers speculators' launch_vllm.py extracts by default: ``[2, n//2, n-3]`` plus the last."""
    n = num_hidden_layers
    return [2, n // 2, n - 3, n]


def cache_files(hidden_states_dir: Path) -> dict[int, Path]:
    """``row -> file`` of the cache (files named ``hs_<row>.safetensors``)."""
    out = {}
    for p in Path(hidden_states_dir).iterdir():
        m = FILE_RE.match(p.name)
        if m:
            out[int(m.group(1))] = p
    return out


def _rows(data_path: Path):
    from hsgen.inputs.hf_datasets import is_saved_dataset

    if not is_saved_dataset(data_path):
        raise ImportError_(f"{data_path}: not a dataset directory speculators' prepare-data writes "
                           "(no dataset_info.json / dataset_dict.json)")  # fmt: skip
    import datasets

    ds = datasets.load_from_disk(str(data_path))
    if isinstance(ds, datasets.DatasetDict):
        ds = ds["train"] if "train" in ds else next(iter(ds.values()))
    missing = {"input_ids", "loss_mask"} - set(ds.column_names)
    if missing:
        raise ImportError_(f"{data_path}: the dataset has no column(s) {sorted(missing)}")
    return ds.with_format(None)


def dataset_fingerprint(data_path: Path) -> str:
    """A hash of the files ``save_to_disk`` wrote (their names, sizes, mtimes and the JSON
    metadata): it changes when prepare-data rewrites the dataset, not when a cache or a store
    beside it changes."""
    import hashlib

    data_path = Path(data_path)
    dirs = [data_path]
    if (data_path / "dataset_dict.json").is_file():
        splits = json.loads((data_path / "dataset_dict.json").read_text()).get("splits", [])
        dirs += [data_path / str(name) for name in splits]
    h = hashlib.sha256()
    for d in dirs:
        for p in sorted(d.iterdir()) if d.is_dir() else ():
            if p.is_file() and p.suffix in (".arrow", ".json"):
                st = p.stat()
                h.update(f"{p.relative_to(data_path)}:{st.st_size}:{st.st_mtime_ns}\n".encode())
                if p.suffix == ".json":
                    h.update(p.read_bytes())
    return h.hexdigest()[:32]


@dataclass
class DatasetRows:
    """The sample id (as ``hsgen generate`` gives a pre-tokenized prompt) and length of each row."""

    fingerprint: str
    ids: list[str]
    lengths: list[int]


def dataset_rows(data_path: str | Path, record: dict | None = None) -> DatasetRows:
    """The rows' ids and lengths: from ``record`` (a store's import record) when the dataset is
    unchanged, else read from the dataset."""
    from hsgen.inputs.formats import content_id

    data_path = Path(data_path)
    fp = dataset_fingerprint(data_path)
    if record and record.get("dataset", {}).get("fingerprint") == fp:
        d = record["dataset"]
        return DatasetRows(fp, list(d["ids"]), [int(n) for n in d["lengths"]])
    rows = _rows(data_path)
    ids, lengths = [], []
    for row in rows.select_columns(["input_ids", "loss_mask"]):
        ids_, mask = [int(t) for t in row["input_ids"]], [int(m) for m in row["loss_mask"]]
        ids.append(content_id({"input_ids": ids_, "loss_mask": mask}))
        lengths.append(len(ids_))
    return DatasetRows(fp, ids, lengths)


def read_record(store_path: str | Path) -> dict:
    try:
        return json.loads((Path(store_path) / RECORD_FILE).read_text())
    except (OSError, ValueError):
        return {}


def _write_record(store_path: Path, record: dict) -> None:
    tmp = store_path / (RECORD_FILE + ".tmp")
    tmp.write_text(json.dumps(record))
    os.replace(tmp, store_path / RECORD_FILE)


def import_cache(
    data_path: str | Path,
    store_path: str | Path,
    *,
    verifier: str,
    layer_ids: Sequence[int] | None = None,
    hidden_states_path: str | Path | None = None,
    chat_template: str | None = None,
    progress: bool | None = None,
) -> ImportResult:
    """Add every readable sample of the cache at ``data_path`` to the store at ``store_path``.

    A row already stored is not read again; its file, if the import record saw it with another
    size or mtime, is compared with the stored sample and a difference raises :class:`StaleCache`.
    """
    from hsgen.client.hidden_file import NotReady, read_hidden_states_file
    from hsgen.inputs.render import ChatRenderer, RenderConfig
    from hsgen.progress import progress_bar
    from hsgen.protocol import extraction as protocol
    from hsgen.protocol.dtypes import all_finite
    from hsgen.store import HiddenStateStore, StoreError
    from hsgen.store.store import HEADER_FILE

    data_path, store_path = Path(data_path), Path(store_path)
    hs_dir = Path(hidden_states_path) if hidden_states_path else data_path / "hidden_states"
    if not hs_dir.is_dir():
        raise ImportError_(f"{hs_dir}: no such directory (the cache's hidden_states/; --hidden-states-path)")
    files = cache_files(hs_dir)
    record = read_record(store_path)
    rows = dataset_rows(data_path, record)
    seen: dict[str, list[int]] = dict(record.get("files", {})) if record.get("dataset") else {}
    store = None
    if (store_path / HEADER_FILE).exists():
        try:
            store = HiddenStateStore.open(store_path)
        except StoreError as e:
            raise ImportError_(str(e)) from None
    have = set(store.sample_ids()) if store is not None else set()
    result = ImportResult(rows=len(rows.ids), store_exists=store is not None)
    result.skipped = [f"{p.name}: no row {r} in {data_path} ({len(rows.ids)} rows)" for r, p in sorted(files.items())
                      if r >= len(rows.ids)]  # fmt: skip
    renderer = None
    writer = None
    table = None  # the dataset itself, opened once a file is to be imported
    try:
        for row in progress_bar(range(len(rows.ids)), desc="import", unit="row", disable=progress is False):
            sid, path = rows.ids[row], files.get(row)
            stat = None
            if path is not None:
                st = path.stat()
                stat = [st.st_size, st.st_mtime_ns]
            if sid in have:
                result.already += 1
                if stat is not None and seen.get(path.name, stat) != stat:
                    _check_unchanged(store, sid, path, store_path)
                if stat is not None:
                    seen[path.name] = stat
                continue
            if path is None:
                result.missing.append(row)
                continue
            try:
                hs, tokens, dtype = read_hidden_states_file(str(path))
            except (NotReady, protocol.ProtocolError, OSError) as e:
                result.skipped.append(f"{path.name}: {e}")
                continue
            if table is None:
                table = _rows(data_path)
            ids, mask = [int(t) for t in table[row]["input_ids"]], [int(m) for m in table[row]["loss_mask"]]
            if list(map(int, tokens)) != ids:
                result.skipped.append(f"{path.name}: its token ids differ from row {row}'s input_ids")
                continue
            if not all_finite(hs, dtype):
                result.skipped.append(f"{path.name}: its hidden states hold NaN or inf")
                continue
            if store is None:
                if renderer is None:
                    renderer = ChatRenderer(
                        RenderConfig(tokenizer_path=str(verifier), chat_template=chat_template)
                    )
                store = _create(store_path, verifier, hs, dtype, layer_ids, renderer.fingerprint)
            if writer is None:
                _check_shape(store.header, hs, dtype, path)
                writer = store.writer(f"import-speculators-{_tag()}")
            writer.add(sid, hs, np.asarray(ids, np.int64), np.asarray(mask, np.uint8))
            have.add(sid)
            seen[path.name] = stat
            result.imported += 1
    finally:
        if writer is not None:
            writer.close()
    result.foreign = len(have - set(rows.ids))
    if store is not None:
        _write_record(store_path, {"hidden_states_path": str(hs_dir.resolve()), "data_path": str(data_path.resolve()),
                                   "dataset": {"fingerprint": rows.fingerprint, "ids": rows.ids,
                                               "lengths": rows.lengths}, "files": seen})  # fmt: skip
        result.store_exists = True
    return result


def _check_unchanged(store, sid: str, path: Path, store_path: Path) -> None:
    """Raise :class:`StaleCache` when ``path`` no longer holds the stored sample's states."""
    from hsgen.client.hidden_file import NotReady, read_hidden_states_file
    from hsgen.protocol import extraction as protocol

    try:
        hs, tokens, _ = read_hidden_states_file(str(path))
    except (NotReady, protocol.ProtocolError, OSError):
        same = False
    else:
        sample = store.read(sid)
        same = np.array_equal(tokens, sample.token_ids) and np.array_equal(
            np.asarray(hs), np.asarray(sample.hidden_states)
        )
    if not same:
        raise StaleCache(f"{path}: changed since it was imported into {store_path} (it holds other states than "
                         "the stored sample): the cache was regenerated; import it into a new store (remove "
                         f"{store_path}, or pass --store NEW)")  # fmt: skip


def _tag() -> str:
    import os
    import time

    return f"{os.getpid()}-{int(time.time())}"


def _check_shape(header, hs: np.ndarray, dtype: str, path: Path) -> None:
    if hs.shape[1] != len(header.layer_ids) or hs.shape[2] != header.hidden_size:
        raise ImportError_(f"{path.name}: {hs.shape[1]} layers of width {hs.shape[2]}, the store holds "
                           f"{len(header.layer_ids)} of width {header.hidden_size}: another cache")  # fmt: skip


def _create(store_path, verifier: str, hs: np.ndarray, dtype: str, layer_ids, fingerprint: str):
    import json

    from hsgen.store import HiddenStateStore, StoreHeader

    n_layers, hidden = int(hs.shape[1]), int(hs.shape[2])
    if layer_ids is None:
        cfg = json.loads((Path(verifier) / "config.json").read_text())
        layer_ids = speculators_layer_ids(int(cfg.get("text_config", cfg)["num_hidden_layers"]))
    layer_ids = [int(i) for i in layer_ids]
    if len(layer_ids) != n_layers:
        raise ImportError_(f"the cache's files hold {n_layers} layers but the layer ids are {layer_ids}: pass "
                           "--layer-ids as vLLM was launched (its eagle_aux_hidden_state_layer_ids)")  # fmt: skip
    header = StoreHeader(verifier=str(verifier), layer_ids=tuple(layer_ids), hidden_size=hidden, dtype=dtype,
                         tokenizer_fingerprint=fingerprint)  # fmt: skip
    return HiddenStateStore.create(store_path, header)
