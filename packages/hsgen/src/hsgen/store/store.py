"""HiddenStateStore: a directory of zarr shards plus per-writer manifests."""

from __future__ import annotations

import json
import logging
import os
import threading
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np

from hsgen.store.backend import Backend, ObjectBackend, is_remote
from hsgen.store.errors import CorruptSample, NotAStore, StoreError, StoreHeaderMismatch
from hsgen.store.fsutil import atomic_write_exclusive, failpoint, fsync_dir
from hsgen.store.header import FORMAT_VERSION, StoreHeader
from hsgen.store.integrity import check_sample
from hsgen.store.manifest import MANIFEST_SUFFIX, ManifestAppender, ManifestReplay, ReplayDelta, ShardInfo
from hsgen.store.records import Sample, SampleRecord
from hsgen.store.remote import (
    ObjectShardFiles,
    RemoteShardWriter,
    SegmentReplay,
    StoreURL,
    delete_objects,
    next_segment,
    put_segment,
    remote_gc,
)
from hsgen.store.shard import ShardReader
from hsgen.store.writer import ShardWriter, default_writer_id, remove_tree

log = logging.getLogger(__name__)

HEADER_FILE = "hsgen-store.json"
"""The store's header file; its presence makes a directory a store."""

STORE_FORMAT = "hsgen-store"
_OWN_ENTRIES = {HEADER_FILE, "manifests", "shards"}
_MAX_OPEN_SHARDS = 64


class _Reader:
    """A cached ShardReader with a user count, closed only when evicted and unused."""

    def __init__(self, reader: ShardReader):
        self.reader = reader
        self.users = 0
        self.evicted = False


class HiddenStateStore:
    """A hidden-state store: open it with :meth:`create` or :meth:`open`.

    Readers see samples committed by other processes after :meth:`refresh`; samples written through
    this object's writers are visible at once. Safe to share between threads.
    """

    def __init__(
        self, path: Path, header: StoreHeader, *, replay: bool = True, backend: Backend | None = None
    ):
        """Use :meth:`create` or :meth:`open` (``backend``: the object store of an ``s3://`` store)."""
        self.path = path
        self.header = header
        self._backend = backend
        self._lock = threading.RLock()
        self._replay = self._new_replay()
        self._index: dict[str, tuple[ShardInfo, int]] = {}
        self._duplicates = 0
        self._order: list[str] | None = None
        self._readers: OrderedDict[str, _Reader] = OrderedDict()
        self._ops: ManifestAppender | None = None
        if replay:
            self.refresh()

    # ------------------------------------------------------------------ opening

    @classmethod
    def create(cls, path, header: StoreHeader, *, exist_ok: bool = True) -> HiddenStateStore:
        """Create a store at ``path``, or open the existing one there if its header matches.

        Raises:
            StoreHeaderMismatch: the existing store holds data of a different meaning or codec.
            StoreError: ``path`` exists and is not a store (or is one and ``exist_ok`` is False).
        """
        if is_remote(path):
            return cls._create_remote(str(path), header, exist_ok=exist_ok)
        path = Path(path)
        header_file = path / HEADER_FILE
        if not header_file.exists():
            if path.exists() and not path.is_dir():
                raise StoreError(f"{path}: exists and is not a directory")
            if path.is_dir():
                foreign = sorted(
                    e for e in os.listdir(path) if e not in _OWN_ENTRIES and not e.startswith(".")
                )
                if foreign:
                    raise StoreError(f"{path}: not empty and not an hsgen store (contains {foreign[:5]})")
            (path / "manifests").mkdir(parents=True, exist_ok=True)
            (path / "shards").mkdir(exist_ok=True)
            fsync_dir(path)
            doc = {
                "format": STORE_FORMAT,
                "format_version": header.format_version,
                "header": header.to_dict(),
            }
            if atomic_write_exclusive(header_file, json.dumps(doc, indent=2).encode() + b"\n"):
                log.info("created store %s", path)
                return cls.open(path)
        elif not exist_ok:
            raise StoreError(f"{path}: a store already exists there")
        return cls._check_same(cls.open(path), header)

    @classmethod
    def _check_same(cls, store: HiddenStateStore, header: StoreHeader) -> HiddenStateStore:
        path = store.path
        problems = store.header.compatible_with(header)
        if store.header.codec != header.codec:
            problems.append(f"codec: store has {store.header.codec!r}, got {header.codec!r}")
        if problems:
            raise StoreHeaderMismatch(
                f"{path}: refusing samples with a different header:\n  " + "\n  ".join(problems), problems
            )
        return store

    @classmethod
    def open(cls, path, *, replay: bool = True) -> HiddenStateStore:
        """Open an existing store.

        Args:
            path: the store directory, or ``s3://bucket/prefix`` (see :mod:`hsgen.store.backend`).
            replay: read the manifests now (``False`` only checks the header; call
                :meth:`refresh` before using samples).

        Raises:
            StoreError: ``path`` is not a store, or was written by a newer format version.
        """
        backend = None
        if is_remote(path):
            backend = ObjectBackend(str(path))
            path = StoreURL(backend.url)
        path = Path(path) if backend is None else path
        header_file = path / HEADER_FILE
        try:
            doc = json.loads(header_file.read_bytes() if backend is None else backend.get(HEADER_FILE))
        except FileNotFoundError as e:
            raise NotAStore(f"{path}: not an hsgen store (no {HEADER_FILE})") from e
        except (ValueError, OSError) as e:
            raise StoreError(f"{header_file}: unreadable store header ({e})") from e
        if not isinstance(doc, dict) or doc.get("format") != STORE_FORMAT:
            raise StoreError(f"{header_file}: not an hsgen store header (format != {STORE_FORMAT!r})")
        try:
            header = StoreHeader.from_dict(doc["header"])
        except (KeyError, ValueError, TypeError) as e:
            raise StoreError(f"{header_file}: invalid header ({e})") from e
        if header.format_version > FORMAT_VERSION:
            raise StoreError(
                f"{header_file}: format version {header.format_version} is newer than this hsgen "
                f"reads ({FORMAT_VERSION}); upgrade hsgen"
            )
        return cls(path, header, replay=replay, backend=backend)

    @classmethod
    def _create_remote(cls, url: str, header: StoreHeader, *, exist_ok: bool) -> HiddenStateStore:
        backend = ObjectBackend(url)
        try:
            backend.get(HEADER_FILE)
        except FileNotFoundError:
            if any(k for k in backend.list() if not k.startswith(tuple(_OWN_ENTRIES))):
                raise StoreError(f"{url}: not empty and not an hsgen store") from None
            doc = {"format": STORE_FORMAT, "format_version": FORMAT_VERSION, "header": header.to_dict()}
            backend.put(HEADER_FILE, json.dumps(doc, indent=2).encode() + b"\n")
            log.info("created store %s", url)
            return cls.open(url)
        if not exist_ok:
            raise StoreError(f"{url}: a store already exists there")
        return cls._check_same(cls.open(url), header)

    def _new_replay(self) -> ManifestReplay:
        if self._backend is not None:
            return SegmentReplay(self._backend)
        return ManifestReplay(self.path / "manifests")

    # ------------------------------------------------------------------ the helpers' interface
    # What store/maintenance, verify, remote and writer use (StoreView in hsgen.store.view).

    @property
    def replay(self) -> ManifestReplay:
        """The manifests as replayed so far: shards committed, deleted, damaged, and problems."""
        return self._replay

    @property
    def backend(self) -> Backend | None:
        """The object store holding this store's bytes; ``None`` for a directory."""
        return self._backend

    def placement(self, sample_id: str) -> tuple[ShardInfo, int] | None:
        """The live copy of ``sample_id``: its shard and row; ``None`` when it is not stored."""
        return self._index.get(sample_id)

    def shard_reader(self, shard: str) -> ShardReader:
        """A reader of committed shard ``shard`` (its objects, on an object store)."""
        files = ObjectShardFiles(self._backend, shard) if self._backend is not None else None
        return ShardReader(self.path / shard, self.header, files)

    # ------------------------------------------------------------------ index

    def refresh(self) -> None:
        """Re-read the manifests (only bytes appended since the last refresh)."""
        with self._lock:
            self._apply(self._replay.refresh())

    def _apply(self, delta: ReplayDelta) -> None:
        if delta.deleted:
            self._rebuild()
            return
        index = self._index
        for info in delta.committed:
            if info.name in self._replay.deleted:
                continue
            self._order = None
            for i, row in enumerate(info.rows):
                current = index.get(row[0])
                if current is None:
                    index[row[0]] = (info, i)
                else:
                    self._duplicates += 1
                    if info.key < current[0].key:
                        index[row[0]] = (info, i)

    def live_shards(self) -> list[ShardInfo]:
        """The committed shards not deleted, in commit order."""
        shards = [s for n, s in self._replay.shards.items() if n not in self._replay.deleted]
        return sorted(shards, key=lambda s: s.key)

    def _rebuild(self) -> None:
        self._index, self._duplicates, self._order = {}, 0, None
        for info in self.live_shards():
            for i, row in enumerate(info.rows):
                if row[0] in self._index:
                    self._duplicates += 1
                else:
                    self._index[row[0]] = (info, i)

    def __contains__(self, sample_id) -> bool:
        return sample_id in self._index

    def __len__(self) -> int:
        return len(self._index)

    def sample_ids(self) -> list[str]:
        """Live sample ids in manifest order (manifest files by name, then line order)."""
        with self._lock:
            if self._order is None:
                self._order = [
                    row[0]
                    for info in self.live_shards()
                    for i, row in enumerate(info.rows)
                    if self._index[row[0]] == (info, i)
                ]
            return list(self._order)

    def record(self, sample_id: str) -> SampleRecord:
        """The manifest record of a live sample (KeyError if absent)."""
        info, i = self._lookup(sample_id)
        sid, offset, length, checksum = info.rows[i]
        return SampleRecord(sid, info.name, offset, length, checksum)

    def _lookup(self, sample_id: str) -> tuple[ShardInfo, int]:
        try:
            return self._index[sample_id]
        except KeyError:
            raise KeyError(f"sample {sample_id!r} is not in store {self.path}") from None

    def shards(self) -> dict[str, list[str]]:
        """Live shard -> ids of the samples it holds."""
        with self._lock:
            return {info.name: [r[0] for r in info.rows] for info in self.live_shards()}

    # ------------------------------------------------------------------ reading

    def _acquire(self, shard: str) -> _Reader:
        with self._lock:
            entry = self._readers.get(shard)
            if entry is None:
                entry = _Reader(self.shard_reader(shard))
                self._readers[shard] = entry
                while len(self._readers) > _MAX_OPEN_SHARDS:
                    _, old = self._readers.popitem(last=False)
                    old.evicted = True
                    if old.users == 0:
                        old.reader.close()
            else:
                self._readers.move_to_end(shard)
            entry.users += 1
            return entry

    def _acquire_for(self, info: ShardInfo, sample_id: str) -> _Reader:
        """:meth:`_acquire` of ``info``'s shard, its failure naming the sample it was opened for."""
        try:
            return self._acquire(info.name)
        except (StoreError, OSError) as e:
            raise self._unreadable(info, sample_id, e) from e

    def _release(self, entry: _Reader) -> None:
        with self._lock:
            entry.users -= 1
            if entry.evicted and entry.users == 0:
                entry.reader.close()

    def read(self, sample_id: str, *, verify: bool = True) -> Sample:
        """Read one live sample (KeyError if absent).

        Args:
            sample_id: the sample.
            verify: check its bytes against the manifest checksum (:class:`CorruptSample`, a
                ``StoreError``, on mismatch); costs a pass over the bytes at several GB/s.
        """
        info, i = self._lookup(sample_id)
        entry = self._acquire_for(info, sample_id)
        try:
            return self._read_row(entry.reader, info, i, verify)
        finally:
            self._release(entry)

    def _unreadable(self, info: ShardInfo, sample_id: str, e: BaseException) -> StoreError:
        """The error for a sample whose rows cannot be read: it names the store, the shard and the sample."""
        return StoreError(f"store {self.path}: shard {info.name}, sample {sample_id!r}: {e}")

    def _read_row(self, reader: ShardReader, info: ShardInfo, i: int, verify: bool) -> Sample:
        sid, offset, length, checksum = info.rows[i]
        try:
            hidden, token_ids, loss_mask, scale = reader.read(offset, length)
            targets = reader.read_targets(offset, length)
        except (StoreError, OSError, EOFError) as e:
            raise self._unreadable(info, sid, e) from e
        if verify:
            record = SampleRecord(sid, info.name, offset, length, checksum)
            check_sample(
                record, hidden, token_ids, loss_mask, scale, store=str(self.path), target_ids=targets
            )
        return Sample(sid, reader.decode(hidden, scale), token_ids, loss_mask, self.header.dtype, targets)

    def read_into(
        self, sample_id: str, hidden: np.ndarray, token_ids: np.ndarray, loss_mask: np.ndarray, *,
        verify: bool = False, target_ids: np.ndarray | None = None,
    ) -> SampleRecord:  # fmt: skip
        """Read one live sample straight into the caller's buffers (no intermediate copy for raw shards).

        Args:
            sample_id: the sample (KeyError if absent).
            hidden: ``[length, L, H]`` C-contiguous, in the storage dtype (uint16 for bfloat16).
            token_ids: ``[length]`` int64.
            loss_mask: ``[length]`` uint8.
            verify: check the checksum as the bytes land.
            target_ids: ``[length]`` int32, filled in an ``argmax`` store (ignored otherwise).

        Returns:
            The sample's manifest record.

        Raises:
            KeyError: the sample is not in the store.
            StoreError: its rows cannot be read (a file missing or cut short), or (``verify``)
                their checksum differs from the manifest's (:class:`CorruptSample`); the
                message names the store, the shard and the sample.
        """
        info, i = self._lookup(sample_id)
        sid, offset, length, checksum = info.rows[i]
        entry = self._acquire_for(info, sid)
        try:
            got = entry.reader.read_into(
                offset,
                length,
                hidden,
                token_ids,
                loss_mask,
                checksum=checksum if verify else None,
                target_ids=target_ids,
            )
        except (StoreError, OSError, EOFError) as e:
            raise self._unreadable(info, sid, e) from e
        finally:
            self._release(entry)
        if verify and got != checksum:
            raise CorruptSample(
                f"store {self.path}: shard {info.name}, sample {sid!r}: the stored bytes' checksum {got} "
                f"differs from the manifest's {checksum} (run hsgen verify)",
                sid,
                info.name,
            )
        return SampleRecord(sid, info.name, offset, length, checksum)

    def read_many(self, sample_ids: Iterable[str], *, verify: bool = True) -> list[Sample]:
        """Read several samples (in the order given), grouping the reads per shard; ``verify`` as :meth:`read`."""
        ids = list(sample_ids)
        located = [self._lookup(s) for s in ids]
        order = sorted(range(len(ids)), key=lambda k: (located[k][0].key, located[k][1]))
        out: list[Sample | None] = [None] * len(ids)
        entry: _Reader | None = None
        try:
            for k in order:
                info, i = located[k]
                if entry is None or entry.reader.root != self.path / info.name:
                    if entry is not None:
                        self._release(entry)
                        entry = None
                    entry = self._acquire_for(info, ids[k])
                out[k] = self._read_row(entry.reader, info, i, verify)
        finally:
            if entry is not None:
                self._release(entry)
        return out  # type: ignore[return-value]

    def __getitem__(self, sample_id: str) -> Sample:
        return self.read(sample_id)

    def __iter__(self) -> Iterator[Sample]:
        """Samples in manifest order."""
        for sid in self.sample_ids():
            yield self.read(sid)

    # ------------------------------------------------------------------ writing

    def writer(self, writer_id: str | None = None, *, shard_bytes: int = 32 << 20, **kwargs) -> ShardWriter:
        """A new :class:`ShardWriter` (``kwargs``: ``chunk_bytes``, ``fsync``)."""
        if self._backend is not None:
            return RemoteShardWriter(self, writer_id, shard_bytes=shard_bytes, **kwargs)
        return ShardWriter(self, writer_id, shard_bytes=shard_bytes, **kwargs)

    def delete_shard(self, shard: str) -> None:
        """Record a tombstone for ``shard`` in the manifest, then remove its files. Idempotent.

        Raises:
            KeyError: no such shard was ever committed.
        """
        with self._lock:
            self.refresh()
            if shard not in self._replay.shards:
                raise KeyError(f"shard {shard!r} was never committed to store {self.path}")
            if shard not in self._replay.deleted and self._backend is not None:
                ops = f"delete-{default_writer_id()}"
                put_segment(
                    self._backend, ops, next_segment(self._backend, ops), [{"op": "delete", "shard": shard}]
                )
                self.refresh()
            elif shard not in self._replay.deleted:
                if self._ops is None:
                    ops_id = f"delete-{default_writer_id()}"
                    self._ops = ManifestAppender(self.path / "manifests" / f"{ops_id}{MANIFEST_SUFFIX}")
                self._ops.append([{"op": "delete", "shard": shard}])
                failpoint("tombstoned")
                self.refresh()
            entry = self._readers.pop(shard, None)
            if entry is not None:
                entry.evicted = True
                if entry.users == 0:
                    entry.reader.close()
        if self._backend is not None:
            delete_objects(self._backend, shard)
        else:
            remove_tree(self.path / shard)

    # ------------------------------------------------------------------ maintenance

    def stats(self) -> dict:
        """Summary from the manifests alone: samples, tokens, bytes, bytes_per_token, shards, writers..."""
        with self._lock:
            live = self.live_shards()
            tokens = sum(info.rows[i][2] for info, i in self._index.values())
            stored_tokens = sum(s.tokens for s in live)
            nbytes = sum(s.nbytes for s in live)
            writers = sorted({s.writer for s in live})
            return {
                "path": str(self.path),
                "samples": len(self._index),
                "tokens": tokens,
                "bytes": nbytes,
                "bytes_per_token": (nbytes / stored_tokens) if stored_tokens else 0.0,
                "shards": len(live),
                "writers": len(writers),
                "writer_ids": writers,
                "deleted_shards": len(self._replay.deleted),
                "duplicates": self._duplicates,
                "manifest_problems": len(self._replay.problems),
                "samples_hidden": self.samples_hidden(),
                "codec": self.header.codec,
                "header": self.header.to_dict(),
            }

    def samples_hidden(self) -> int:
        """Live shards' samples that damaged manifest lines hide from readers (``hsgen verify``
        names them, ``hsgen gc --repair`` recovers them); 0 in a healthy store."""
        with self._lock:
            return sum(s.hidden for s in self.live_shards())

    def verify(self, *, progress: bool = False) -> list[str]:
        """Check every live sample's checksum and every shard's shapes; returns problems, [] if healthy."""
        from hsgen.store.verify import verify_store

        return verify_store(self, progress=progress)

    def gc(
        self,
        *,
        dry_run: bool = False,
        min_age_s: float = 60.0,
        dedupe: bool = True,
        repair: bool = False,
    ) -> dict:
        """Reclaim space: temp files, uncommitted shards of dead writers, tombstoned shards, duplicates.

        Nothing of a live writer (its manifest lock is held) is touched.

        Args:
            dry_run: only count what would be removed.
            min_age_s: leave store-level temp files younger than this (a create may be running).
            dedupe: drop the later copies of sample ids stored more than once.
            repair: first rebuild damaged manifests of dead writers from their shards' tables.

        Returns:
            ``removed_temp``, ``removed_deleted``, ``removed_uncommitted``, ``bytes_freed``,
            ``live_writers``, ``kept_damaged``, ``duplicates_removed``, ``duplicates_kept``,
            the ``repair`` counts when asked, and ``dry_run``.
        """
        from hsgen.store import maintenance

        if self._backend is not None:
            return {**remote_gc(self, dry_run=dry_run, min_age_s=min_age_s), "dry_run": dry_run}
        self.refresh()
        out: dict = {}
        if repair:
            out.update(maintenance.repair_manifests(self, dry_run=dry_run))
        if dedupe:
            out.update(maintenance.dedupe(self, dry_run=dry_run))
        self.refresh()
        left = maintenance.remove_leftovers(
            self, dry_run=dry_run, min_age_s=min_age_s, header_file=HEADER_FILE
        )
        if dedupe:
            left["bytes_freed"] += out.get("duplicate_bytes", 0) if dry_run else 0
        out = {**left, **out}
        out["dry_run"] = dry_run
        return out

    def reload(self) -> None:
        """Forget what was replayed and read every manifest again (after one was rewritten)."""
        with self._lock:
            self._replay = self._new_replay()
            self._replay.refresh()
            self._rebuild()

    def close(self) -> None:
        """Close cached shard files and the tombstone manifest."""
        with self._lock:
            for entry in self._readers.values():
                entry.evicted = True
                if entry.users == 0:
                    entry.reader.close()
            self._readers.clear()
            if self._ops is not None:
                self._ops.close()
                self._ops = None

    def __enter__(self) -> HiddenStateStore:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"HiddenStateStore({str(self.path)!r}, samples={len(self)}, codec={self.header.codec!r})"
