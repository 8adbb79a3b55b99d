"""A store on an object store (``s3://bucket/prefix``): the same layout, no rename, no append.

An object store has neither rename nor append, so the two steps that make a store crash-safe on
disk are built differently (``docs/format.md``):

- a shard is written to a local staging directory, then uploaded object by object under its
  final keys (``shards/<writer>/<seq>.zarr/...``); it is *visible* only once the manifest
  names it, so a half-uploaded shard is an orphan that no reader ever opens;
- the manifest is one object per committed shard, ``manifests/<writer>/<seq>.jsonl`` holding
  the shard's ``add`` lines and its ``commit``: a PUT is atomic, so a segment is whole or absent,
  and it is written only after every object of its shard. A kill at any moment loses at most
  the shard being uploaded; the next run resumes from the segments.

Tombstones are segments too (``manifests/delete-<id>/<n>.jsonl``). ``gc`` removes the objects of
tombstoned shards and of shards no segment names once they are older than ``min_age_s``.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hsgen.store.backend import Backend
from hsgen.store.fsutil import failpoint
from hsgen.store.manifest import MANIFEST_SUFFIX, ManifestReplay, ReplayDelta, _FileState, encode
from hsgen.store.shard_builder import ShardBuilder, WrittenShard
from hsgen.store.writer import SEQ_PREFIX, ShardWriter

if TYPE_CHECKING:
    from hsgen.store.view import StoreView

log = logging.getLogger(__name__)

UPLOAD_THREADS = 16
"""Objects of one shard uploaded at once."""


class StoreURL(str):
    """An object-store location that joins like a path: ``url / "shards/x"`` is ``url + "/shards/x"``."""

    def __truediv__(self, other: Any) -> StoreURL:
        return StoreURL(f"{self.rstrip('/')}/{str(other).strip('/')}")

    @property
    def name(self) -> str:
        return self.rstrip("/").rsplit("/", 1)[-1]


class ObjectShardFiles:
    """The objects of one shard, read with ranged GETs (the same calls as ``LocalShardFiles``)."""

    remote = True

    def __init__(self, backend: Backend, prefix: str):
        self.backend = backend
        self.prefix = prefix.strip("/")
        self._sizes: dict[str, int] = {}

    def read_bytes(self, rel: str) -> bytes:
        return self.backend.get(f"{self.prefix}/{rel}")

    def read_into(self, rel: str, view: memoryview, offset: int) -> None:
        self.backend.read_into(f"{self.prefix}/{rel}", view, offset)

    def size(self, rel: str) -> int:
        if rel not in self._sizes:
            self._sizes[rel] = self.backend.size(f"{self.prefix}/{rel}")
        return self._sizes[rel]

    def zarr_store(self):
        return self.backend.zarr_store(self.prefix)

    def close(self) -> None:
        pass


class SegmentReplay(ManifestReplay):
    """Replays ``manifests/<writer>/<n>.jsonl`` segments; each is read once (they never change)."""

    def __init__(self, backend: Backend):
        super().__init__(Path("manifests"))
        self.backend = backend
        self._read: set[str] = set()

    def refresh(self) -> ReplayDelta:
        delta = ReplayDelta()
        for key in self.backend.list("manifests/"):
            if key in self._read or not key.endswith(MANIFEST_SUFFIX):
                continue
            try:
                data = self.backend.get(key)
            except FileNotFoundError:
                continue
            self._read.add(key)
            rel = key[len("manifests/") :]
            end = data.rfind(b"\n")
            block = data[:end] if end >= 0 else b""
            self._apply_block(rel, rel.split("/")[0], f"{self.backend.url}/{key}", _FileState(), block, delta)
        return delta


def put_segment(backend: Backend, writer: str, seq: int, records: list[dict]) -> str:
    """Write one manifest segment (atomic); returns its key."""
    key = f"manifests/{writer}/{seq:08d}{MANIFEST_SUFFIX}"
    backend.put(key, b"".join(encode(r) for r in records))
    return key


def next_segment(backend: Backend, writer: str) -> int:
    """The next free segment number of ``writer`` (1 for a new one)."""
    seqs = [int(m.group(1)) for k in backend.list(f"manifests/{writer}/") if (m := re.search(r"(\d{8})", k))]
    return max(seqs, default=0) + 1


class RemoteShardWriter(ShardWriter):
    """A :class:`ShardWriter` of an object-store store: stage on local disk, upload, then the segment."""

    direct_rows = False  # the staged shard is read back at once for its upload: keep it in the page cache

    def _open(self) -> int:
        self._backend: Backend = self.store.backend
        self._stage = Path(tempfile.mkdtemp(prefix=f"hsgen-stage-{self.writer_id}-"))
        self._dir = self._stage
        self._uploads = ThreadPoolExecutor(UPLOAD_THREADS, thread_name_prefix=f"hsgen-put-{self.writer_id}")
        self.store.refresh()
        prefix = f"shards/{self.writer_id}/"
        seqs = [
            int(m.group(1)) for k in self._backend.list(prefix) if (m := SEQ_PREFIX.match(k[len(prefix) :]))
        ]
        seqs.append(next_segment(self._backend, self.writer_id) - 1)
        return max(seqs, default=0) + 1

    def _close_target(self) -> None:
        if hasattr(self, "_uploads"):
            self._uploads.shutdown()
        if hasattr(self, "_stage"):
            shutil.rmtree(self._stage, ignore_errors=True)

    def _temp_dir(self, name: str) -> Path:
        return self._stage / f"{name}.tmp"

    def _publish(self, name: str, shard: ShardBuilder) -> WrittenShard:
        local = self._stage / name
        written = shard.seal(local, fsync=False)  # the upload is durable
        try:
            files = [
                os.path.relpath(os.path.join(d, f), local).replace(os.sep, "/")
                for d, _dirs, names in os.walk(local)
                for f in names
            ]
            prefix = f"shards/{self.writer_id}/{name}"
            body = sorted(f for f in files if f != "zarr.json")
            self._put_file(prefix, local, body[0])
            failpoint("shard_upload_started")
            list(self._uploads.map(lambda rel: self._put_file(prefix, local, rel), body[1:]))
            self._put_file(prefix, local, "zarr.json")  # the group last: a listing shows it complete
            failpoint("shard_uploaded")
        finally:
            shutil.rmtree(local, ignore_errors=True)
        return written

    def _put_file(self, prefix: str, local: Path, rel: str) -> None:
        self._backend.put(f"{prefix}/{rel}", (local / rel).read_bytes())

    def _append(self, lines: list[dict]) -> None:
        seq = int(lines[-1]["shard"].rsplit("/", 1)[-1][:8])
        put_segment(self._backend, self.writer_id, seq, lines)


def shard_of(key: str) -> str | None:
    """``shards/<writer>/<seq>.zarr`` of an object key under it (None for other keys)."""
    parts = key.split("/")
    if len(parts) >= 4 and parts[0] == "shards" and SEQ_PREFIX.match(parts[2]):
        return "/".join(parts[:3])
    return None


def delete_objects(backend: Backend, shard: str) -> int:
    """Remove every object of ``shard``; returns their total size."""
    freed = 0
    for key in backend.list(shard + "/"):
        try:
            freed += backend.size(key)
        except FileNotFoundError:
            continue
        backend.delete(key)
    return freed


def remote_gc(store: StoreView, *, dry_run: bool, min_age_s: float) -> dict:
    """Remove tombstoned shards' objects, and shards no segment names once ``min_age_s`` old."""
    backend: Backend = store.backend
    store.refresh()
    replay = store.replay
    out = {"removed_temp": 0, "removed_deleted": 0, "removed_uncommitted": 0, "bytes_freed": 0}
    out["live_writers"] = 0
    shards: dict[str, list[str]] = {}
    for key in backend.list("shards/"):
        shard = shard_of(key)
        if shard is not None:
            shards.setdefault(shard, []).append(key)
    started = time.time()
    for shard, keys in sorted(shards.items()):
        if shard in replay.shards and shard not in replay.deleted:
            continue
        kind = "removed_deleted" if shard in replay.deleted else "removed_uncommitted"
        if kind == "removed_uncommitted" and not _older_than(store, shard, keys, started - min_age_s):
            out["live_writers"] += 1  # probably being uploaded right now
            continue
        out[kind] += 1
        if dry_run:
            out["bytes_freed"] += sum(backend.size(k) for k in keys)
        else:
            out["bytes_freed"] += delete_objects(backend, shard)
    return out


def _older_than(store: StoreView, shard: str, keys: list[str], cutoff: float) -> bool:
    """Whether every object of ``shard`` was last written before ``cutoff`` (else it may be uploading)."""
    try:
        return max(store.backend.mtime(k) for k in keys) < cutoff
    except FileNotFoundError:
        return False


__all__ = [
    "ObjectShardFiles",
    "RemoteShardWriter",
    "SegmentReplay",
    "StoreURL",
    "delete_objects",
    "next_segment",
    "put_segment",
    "remote_gc",
    "shard_of",
]
