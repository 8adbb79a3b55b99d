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

import logging
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

log = logging.getLogger(__name__)

FILE_RE = re.compile(r"^hs_(\d+)\.safetensors$")


class ImportError_(ValueError):
    """The cache cannot be imported at all (one line naming the path or flag)."""


@dataclass
class ImportResult:
    imported: int = 0
    already: int = 0
    skipped: list[str] = field(default_factory=list)
    """``file: reason`` of each file left out."""
    missing_rows: int = 0
    """Dataset rows without a hidden-state file (not generated yet)."""

    def summary(self) -> dict:
        return {"imported": self.imported, "already_stored": self.already, "skipped": len(self.skipped),
                "rows_without_file": self.missing_rows}  # fmt: skip


def speculators_layer_ids(num_hidden_layers: int) -> list[int]:
    """The layers speculators' launch_vllm.py extracts by default: ``[2, n//2, n-3]`` plus the last."""
    n = num_hidden_layers
    return [2, n // 2, n - 3, n]


def cache_files(hidden_states_dir: Path) -> dict[int, Path]:
    """``row -> file`` of the cache (files named ``hs_<row>.safetensors``)."""
    out = {}
    for p in hidden_states_dir.iterdir():
        m = FILE_RE.match(p.name)
        if m:
            out[int(m.group(1))] = p
    return out


def _rows(data_path: Path):
    from hsgen.hf_datasets import is_saved_dataset

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
    """Add every readable sample of the cache at ``data_path`` to the store at ``store_path``."""
    from hsgen import protocol
    from hsgen.hidden_file import NotReady, read_hidden_states_file
    from hsgen.inputs import content_id
    from hsgen.progress import progress_bar
    from hsgen.render import ChatRenderer, RenderConfig
    from hsgen.store import HiddenStateStore, StoreError
    from hsgen.store.store import HEADER_FILE

    data_path = Path(data_path)
    hs_dir = Path(hidden_states_path) if hidden_states_path else data_path / "hidden_states"
    if not hs_dir.is_dir():
        raise ImportError_(f"{hs_dir}: no such directory (the cache's hidden_states/; --hidden-states-path)")
    files = cache_files(hs_dir)
    if not files:
        raise ImportError_(f"{hs_dir}: no hs_<row>.safetensors file")
    rows = _rows(data_path)
    renderer = ChatRenderer(RenderConfig(tokenizer_path=str(verifier), chat_template=chat_template))
    result = ImportResult(missing_rows=sum(1 for i in range(len(rows)) if i not in files))
    store = None
    if (Path(store_path) / HEADER_FILE).exists():
        try:
            store = HiddenStateStore.open(store_path)
        except StoreError as e:
            raise ImportError_(str(e)) from None
    have = set(store.sample_ids()) if store is not None else set()
    writer = None
    try:
        for row in progress_bar(sorted(files), desc="import", unit="file", disable=progress is False):
            path = files[row]
            if row >= len(rows):
                result.skipped.append(f"{path.name}: no row {row} in {data_path} ({len(rows)} rows)")
                continue
            ids = [int(t) for t in rows[row]["input_ids"]]
            mask = [int(m) for m in rows[row]["loss_mask"]]
            sid = content_id({"input_ids": ids, "loss_mask": mask})
            if sid in have:
                result.already += 1
                continue
            try:
                hs, tokens, dtype = read_hidden_states_file(str(path))
            except (NotReady, protocol.ProtocolError, OSError) as e:
                result.skipped.append(f"{path.name}: {e}")
                continue
            if list(map(int, tokens)) != ids:
                result.skipped.append(f"{path.name}: its token ids differ from row {row}'s input_ids")
                continue
            if store is None:
                store = _create(store_path, verifier, hs, dtype, layer_ids, renderer.fingerprint)
            if writer is None:
                _check_shape(store.header, hs, dtype, path)
                writer = store.writer(f"import-speculators-{_tag()}")
            writer.add(sid, hs, np.asarray(ids, np.int64), np.asarray(mask, np.uint8))
            have.add(sid)
            result.imported += 1
    finally:
        if writer is not None:
            writer.close()
    return result


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
