"""Opening a store a run is about to fill: the one that exists at a path, or none yet, and whether
it holds what the run will send (the policy ``hsgen generate`` applies before any request)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hsgen.store.backend import is_remote
from hsgen.store.errors import NotAStore, StoreHeaderMismatch
from hsgen.store.store import HEADER_FILE, HiddenStateStore


def open_existing(path: Any) -> HiddenStateStore | None:
    """The store at ``path``, or ``None`` when none was created there yet: no header (on an object
    store), or a directory absent or holding only hidden entries (a first run's lease).

    Raises:
        StoreError: something is there and is not a readable store.
    """
    if is_remote(path):
        try:
            return HiddenStateStore.open(path)
        except (FileNotFoundError, NotAStore):
            return None
    path = Path(path)
    if not (path / HEADER_FILE).exists() and (not path.is_dir() or not _visible_entries(path)):
        return None
    return HiddenStateStore.open(path)


def check_matches(store: HiddenStateStore, *, layer_ids: Sequence[int] | None = None, dtype: str | None = None,
                  fingerprint: str = "", targets: str | None = None) -> None:  # fmt: skip
    """Raise :class:`~hsgen.store.errors.StoreHeaderMismatch` naming each field where ``store`` holds
    something else than the run asks for (a field not asked for is not compared)."""
    h, problems = store.header, []
    if layer_ids is not None and tuple(layer_ids) != tuple(h.layer_ids):
        problems.append(f"layer ids: the store holds {list(h.layer_ids)}, --layer-ids says {list(layer_ids)}")
    if dtype is not None and dtype != h.dtype:
        problems.append(f"dtype: the store holds {h.dtype} hidden states, --dtype says {dtype}")
    if fingerprint and h.tokenizer_fingerprint and fingerprint != h.tokenizer_fingerprint:
        problems.append(f"tokenizer: the store was rendered with another tokenizer or chat template (fingerprint "
                        f"{h.tokenizer_fingerprint[:12]}..., now {fingerprint[:12]}...)")  # fmt: skip
    if targets is not None and targets != h.targets:
        problems.append(f"targets: the store keeps targets {h.targets!r}, --targets says {targets!r}")
    if problems:
        raise StoreHeaderMismatch(f"{store.path}: {'; '.join(problems)}: use another store", problems)


def _visible_entries(path: Path) -> list[str]:
    return [e for e in os.listdir(path) if not e.startswith(".")]


__all__ = ["check_matches", "open_existing"]
