"""The online scratch store on disk: where it goes, how big it is, and opening (or wiping) it."""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
from pathlib import Path

from hsgen.store import HiddenStateStore, StoreError, StoreHeader

log = logging.getLogger(__name__)

SCRATCH_MARKER = ".spectrain-scratch"
"""File that marks a directory as an online scratch store (safe to wipe on a header change)."""

PER_SAMPLE_OVERHEAD = 4096
"""Bytes counted per sample on top of its arrays (manifest line, zarr metadata share)."""


def choose_scratch_dir(
    save_path: str | None, rank: int, needed_bytes: int, shm: str = "/dev/shm", split: str = "train"
) -> Path:
    """The default scratch directory: tmpfs when it has ``needed_bytes`` free, else next to the save path.

    The name depends only on the save path, split and rank, so a resumed run finds its scratch again.
    """
    key = hashlib.sha1(os.path.abspath(save_path or os.getcwd()).encode()).hexdigest()[:12]
    suffix = f"rank{rank}" if split == "train" else f"{split}-rank{rank}"
    shm_dir = Path(shm) / f"spectrain-scratch-{key}-{suffix}"
    if os.path.isdir(shm) and os.access(shm, os.W_OK):
        have = shutil.disk_usage(shm).free + (dir_bytes(shm_dir) if shm_dir.exists() else 0)
        if have >= needed_bytes * 1.1:
            return shm_dir
        log.info(
            "%s has %.2f GB free, %.2f GB needed: scratch goes next to the save path",
            shm,
            have / 1e9,
            needed_bytes / 1e9,
        )
    base = Path(save_path) if save_path else Path.cwd()
    return base / f"online-scratch-{suffix}"


def dir_bytes(path: str | os.PathLike[str]) -> int:
    """Bytes of the regular files under ``path`` (0 when it does not exist)."""
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except FileNotFoundError:
                continue
    return total


def open_scratch_store(path: Path, header: StoreHeader) -> HiddenStateStore:
    """Open (or create) the scratch store at ``path``, marked as scratch and garbage-collected.

    A marked scratch directory whose header differs is wiped; an unmarked non-empty one is refused.
    """
    if path.exists() and (path / SCRATCH_MARKER).exists():
        try:
            scratch = HiddenStateStore.create(path, header, exist_ok=True)
        except StoreError as e:
            log.warning("scratch %s holds other data (%s): wiping it", path, e)
            shutil.rmtree(path)
            scratch = HiddenStateStore.create(path, header)
    elif path.exists() and any(path.iterdir()):
        raise StoreError(f"scratch directory {path} exists and is not an online scratch store: pick another")
    else:
        scratch = HiddenStateStore.create(path, header, exist_ok=True)
    (path / SCRATCH_MARKER).touch()
    scratch.gc()
    return scratch
