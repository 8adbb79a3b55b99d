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


def scratch_dirs(
    save_path: str | None, rank: int, shm: str = "/dev/shm", split: str = "train"
) -> tuple[Path, Path]:
    """``(on tmpfs, next to the save path)``: the two places a rank's scratch store may be.

    The names depend only on the save path, split and rank, so a resumed run finds its scratch again.
    """
    key = hashlib.sha1(os.path.abspath(save_path or os.getcwd()).encode()).hexdigest()[:12]
    suffix = f"rank{rank}" if split == "train" else f"{split}-rank{rank}"
    base = Path(save_path) if save_path else Path.cwd()
    return Path(shm) / f"spectrain-scratch-{key}-{suffix}", base / f"online-scratch-{suffix}"


def choose_scratch_dir(
    save_path: str | None,
    rank: int,
    needed_bytes: int,
    shm: str = "/dev/shm",
    split: str = "train",
    needed_what: str = "the scratch needs",
) -> Path:
    """The default scratch directory: tmpfs when it has ``needed_bytes`` free, else next to the save path.

    ``needed_what`` says in the log line what ``needed_bytes`` is (the bound, or the run's samples).
    """
    shm_dir, disk_dir = scratch_dirs(save_path, rank, shm, split)
    if os.path.isdir(shm) and os.access(shm, os.W_OK):
        have = shutil.disk_usage(shm).free + (dir_bytes(shm_dir) if shm_dir.exists() else 0)
        if have >= needed_bytes * 1.1:
            return shm_dir
        log.info(
            "%s has %.2f GB free, %s %.2f GB: scratch goes to %s", shm, have / 1e9, needed_what,
            needed_bytes / 1e9, disk_dir,
        )  # fmt: skip
    return disk_dir


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
