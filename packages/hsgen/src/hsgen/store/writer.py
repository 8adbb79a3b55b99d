"""ShardWriter: buffers whole samples and commits them as shards plus manifest records."""

from __future__ import annotations

import logging
import os
import re
import secrets
import shutil
import socket
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from hsgen.client.phases import PhaseTimes, timer
from hsgen.store.errors import SampleRejected, StoreError
from hsgen.store.fsutil import fsync_dir
from hsgen.store.header import LOGICAL_DTYPES
from hsgen.store.manifest import MANIFEST_SUFFIX, ManifestAppender
from hsgen.store.records import SampleRecord
from hsgen.store.shard_builder import ShardBuilder, WrittenShard, staging_buffers

if TYPE_CHECKING:
    from hsgen.store.view import StoreView

log = logging.getLogger(__name__)

WRITER_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")
SHARD_NAME = re.compile(r"^(\d{8})\.zarr$")
SEQ_PREFIX = re.compile(r"^(\d{8})\.zarr")


def default_writer_id() -> str:
    """``<host>-<pid>-<6 hex>``: unique per writer, readable in ``hsgen status``."""
    host = re.sub(r"[^A-Za-z0-9_.-]", "-", socket.gethostname())[:64] or "host"
    return f"{host}-{os.getpid()}-{secrets.token_hex(3)}"


def remove_tree(path: Path) -> None:
    """Remove a shard directory: rename it to a ``.trash-`` name first so it never looks half-present."""
    trash = (
        path.with_name(f"{path.name}.trash-{secrets.token_hex(4)}") if ".trash-" not in path.name else path
    )
    try:
        if trash != path:
            os.rename(path, trash)
            fsync_dir(path.parent)
    except FileNotFoundError:
        return
    shutil.rmtree(trash, ignore_errors=True)


def _check_targets(sample_id: str, target_ids, tokens: int, stored: bool) -> np.ndarray | None:
    """``target_ids`` as contiguous int32, checked against the store's ``targets``."""
    if not stored:
        if target_ids is not None:
            raise ValueError(
                f"sample {sample_id!r}: target_ids given, but the store keeps final-layer states"
            )
        return None
    if target_ids is None:
        raise ValueError(
            f"sample {sample_id!r}: the store keeps target ids (targets argmax): pass target_ids"
        )
    t = np.asarray(target_ids)
    if t.shape != (tokens,) or (t.size and t.dtype.kind not in "iu"):
        raise ValueError(
            f"sample {sample_id!r}: target_ids must be [{tokens}] integers, got shape {t.shape} dtype {t.dtype}"
        )
    if t.size and (int(t.min()) < 0 or int(t.max()) > np.iinfo(np.int32).max):
        raise ValueError(f"sample {sample_id!r}: target_ids must be token ids in [0, 2^31)")
    return np.ascontiguousarray(t, dtype="<i4")


class ShardWriter:
    """Appends samples to a store. One per process or thread; use as a context manager.

    ``add`` writes each sample's rows into the shard being filled at once (an ``lz4`` store keeps
    the arrays until the shard is sealed): the caller may reuse its arrays, or close the file its
    rows are in, as soon as ``add`` returns. When the shard reaches ``shard_bytes`` it is sealed
    and committed (index, fsync, rename, manifest records) on a background thread while the
    caller keeps adding to the next one (at most one shard in flight). A sample is durable only
    after ``flush`` (or ``close``) returns. An error of a background commit is raised by the next
    ``add``, ``flush`` or ``close``; that shard's samples are lost (:attr:`lost` counts them: a
    resumed run fetches them again).
    """

    direct_rows = True
    """Write a durable shard's rows with ``O_DIRECT`` (:mod:`hsgen.store.shard_builder`)."""

    def __init__(
        self,
        store: StoreView,
        writer_id: str | None = None,
        *,
        shard_bytes: int = 32 << 20,
        chunk_bytes: int = 1 << 20,
        fsync: bool = True,
        phases: PhaseTimes | None = None,
    ):
        """Open writer ``writer_id`` (default: a fresh unique id) of ``store``.

        Args:
            store: the store to add to.
            writer_id: names this writer's manifest and shard directory; reuse one to resume it.
            shard_bytes: commit a shard once its hidden states reach this size.
            chunk_bytes: size of zarr inner chunks inside a shard (the unit a compressed read fetches).
            fsync: fsync shards and manifest lines (turn off only for throwaway stores).
            phases: where the seconds of each phase of writing are added (None: not timed).

        Raises:
            StoreError: another live process uses ``writer_id``.
        """
        writer_id = writer_id or default_writer_id()
        if not WRITER_ID.match(writer_id):
            raise ValueError(f"writer_id {writer_id!r} must match {WRITER_ID.pattern}")
        if shard_bytes <= 0 or chunk_bytes <= 0:
            raise ValueError("shard_bytes and chunk_bytes must be positive")
        self.store = store
        self.writer_id = writer_id
        self.shard_bytes = shard_bytes
        self.chunk_bytes = chunk_bytes
        self.fsync = fsync
        self.phases = phases
        self.header = store.header
        self.lost = 0
        """Samples added whose shard failed to commit (they are not in the store)."""
        self._manifest: ManifestAppender | None = None
        self._shard: ShardBuilder | None = None  # the shard being filled
        self._shard_seq = 0
        self._shard_ids: set[str] = set()
        self._shard_bytes = 0
        self._staging: list[tuple[memoryview, memoryview]] = []
        self._closed = False
        self._io_pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix=f"hsgen-fsync-{writer_id}")
        self._committer = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"hsgen-commit-{writer_id}")
        self._row_io = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"hsgen-rows-{writer_id}")
        self._inflight: tuple[Future, int] | None = None  # the commit in the background, its samples
        try:
            self._seq = self._open()
        except BaseException:
            self._io_pool.shutdown()
            self._committer.shutdown()
            self._row_io.shutdown()
            self._close_target()
            raise

    def _open(self) -> int:
        """Take the writer's manifest and shard directory; return the next shard sequence number."""
        self._manifest = ManifestAppender(
            self.store.path / "manifests" / f"{self.writer_id}{MANIFEST_SUFFIX}"
        )
        self._dir = self.store.path / "shards" / self.writer_id
        if not self._dir.exists():
            self._dir.mkdir(parents=True)
            fsync_dir(self._dir.parent)
        return self._recover()

    def _close_target(self) -> None:
        if self._manifest is not None:
            self._manifest.close()

    def _temp_dir(self, name: str) -> Path:
        """Where shard ``name`` is built before its rename."""
        return self._dir / f"{name}.tmp-{secrets.token_hex(4)}"

    def _publish(self, name: str, shard: ShardBuilder) -> WrittenShard:
        """Seal ``shard`` as shard ``name`` of this writer, complete (renamed into place, fsync'd)."""
        return shard.seal(self._dir / name, fsync=self.fsync, io_pool=self._io_pool)

    def _append(self, lines: list[dict]) -> None:
        """Make the shard's manifest records durable."""
        assert self._manifest is not None
        with timer(self.phases, "manifest"):
            self._manifest.append(lines, fsync=self.fsync)

    def _recover(self) -> int:
        """Remove this writer's leftovers of a crash; return the next shard sequence number."""
        self.store.refresh()
        committed = {n for n, s in self.store.replay.shards.items() if s.writer == self.writer_id}
        seqs = [
            int(SEQ_PREFIX.match(Path(n).name).group(1)) for n in committed if SEQ_PREFIX.match(Path(n).name)
        ]
        for entry in os.listdir(self._dir):
            m = SEQ_PREFIX.match(entry)
            if m:
                seqs.append(int(m.group(1)))
            rel = f"shards/{self.writer_id}/{entry}"
            if SHARD_NAME.match(entry) and rel in committed:
                continue
            log.warning("%s: removing %s left by an interrupted write", self.store.path, rel)
            remove_tree(self._dir / entry)
        return max(seqs, default=0) + 1

    @property
    def pending(self) -> int:
        """Samples added but not yet known durable (in the shard being filled or being committed)."""
        inflight = 0
        if self._inflight is not None:
            if self._inflight[0].done() and self._inflight[0].exception() is None:
                self._inflight = None
            else:
                inflight = self._inflight[1]
        return (len(self._shard) if self._shard is not None else 0) + inflight

    def add(
        self,
        sample_id: str,
        hidden_states,
        token_ids,
        loss_mask=None,
        *,
        target_ids=None,
        check_finite: bool = False,
    ) -> None:
        """Add one whole sample to the shard being filled; seals it once it reaches ``shard_bytes``.

        Args:
            sample_id: unique id of the sample.
            hidden_states: ``[T, n_layers, H]`` in the storage dtype (uint16 for bfloat16; an
                ml_dtypes bfloat16 array is accepted too), or the rows still in a file
                (:class:`hsgen.client.hidden_file.FileRows`), read in pieces as they are written.
            token_ids: ``[T]`` integer token ids.
            loss_mask: ``[T]`` 0/1 values; ``None`` means all ones.
            target_ids: ``[T]`` non-negative token ids, the verifier's greedy next token after
                each position: required by an ``argmax`` store, refused by any other.
            check_finite: refuse the sample when a hidden-state value is NaN or infinite
                (checked piece by piece as it is written).

        Raises:
            ValueError: a shape, dtype or value does not fit the store header.
            SampleRejected: ``check_finite`` found a value that is not finite, or the rows' file
                is shorter than it said: nothing of the sample is stored, the writer goes on.
            OSError: a write failed; the shard being filled is dropped (its samples counted in
                :attr:`lost`).
        """
        if self._closed:
            raise StoreError(f"{self.store.path}: writer {self.writer_id} is closed")
        if not isinstance(sample_id, str) or not sample_id:
            raise ValueError(f"sample_id must be a non-empty string, got {sample_id!r}")
        if sample_id in self._shard_ids:
            raise ValueError(f"sample {sample_id!r} was already added to this writer")
        h = self.header
        hidden = hidden_states if hasattr(hidden_states, "read_range") else np.asarray(hidden_states)
        if hidden.dtype == LOGICAL_DTYPES[h.dtype] and hidden.dtype != h.storage_dtype:
            hidden = hidden.view(h.storage_dtype)
        if hidden.dtype != h.storage_dtype:
            raise ValueError(
                f"sample {sample_id!r}: hidden_states dtype {hidden.dtype} does not match the store "
                f"({h.dtype}, stored as {h.storage_dtype})"
            )
        if (
            hidden.ndim != 3
            or tuple(hidden.shape[1:]) != (h.num_layers, h.hidden_size)
            or hidden.shape[0] == 0
        ):
            raise ValueError(
                f"sample {sample_id!r}: hidden_states shape {tuple(hidden.shape)} must be "
                f"[T>0, {h.num_layers}, {h.hidden_size}] (layers {list(h.layer_ids)})"
            )
        tokens = hidden.shape[0]
        ids = np.asarray(token_ids)
        if ids.shape != (tokens,) or (ids.size and ids.dtype.kind not in "iu"):
            raise ValueError(
                f"sample {sample_id!r}: token_ids must be [{tokens}] integers, got shape {ids.shape} dtype {ids.dtype}"
            )
        ids = np.ascontiguousarray(ids, dtype="<i8")
        if loss_mask is None:
            mask = np.ones(tokens, dtype=np.uint8)
        else:
            m = np.asarray(loss_mask)
            if m.shape != (tokens,):
                raise ValueError(f"sample {sample_id!r}: loss_mask shape {m.shape} must be [{tokens}]")
            if m.size and not np.isin(m, (0, 1)).all():
                raise ValueError(f"sample {sample_id!r}: loss_mask values must be 0 or 1")
            mask = np.ascontiguousarray(m, dtype=np.uint8)
        targets = _check_targets(sample_id, target_ids, tokens, h.target_ids_stored)
        nbytes = int(hidden.nbytes)
        if self._shard is not None and self._shard_bytes + nbytes > self.shard_bytes:
            self._flush_background()
        shard = self._filling()
        try:
            shard.add(sample_id, hidden, ids, mask, targets, check_finite=check_finite)
        except SampleRejected:
            raise
        except BaseException:
            self._drop_filling()
            raise
        self._shard_ids.add(sample_id)
        self._shard_bytes += nbytes
        if self._shard_bytes >= self.shard_bytes:
            self._flush_background()

    def _filling(self) -> ShardBuilder:
        """The shard being filled (a new one, with the next sequence number, when there is none)."""
        if self._shard is None:
            seq = self._seq
            self._seq += 1
            name = f"{seq:08d}.zarr"
            if not self._staging:  # a pair for the shard being filled, a pair for the one being sealed
                self._staging = [staging_buffers(), staging_buffers()]
            self._shard = ShardBuilder(self._temp_dir(name), self.header, chunk_bytes=self.chunk_bytes,
                                       staging=self._staging[seq % 2], io=self._row_io,
                                       direct=self.fsync and self.direct_rows, phases=self.phases)  # fmt: skip
            self._shard_seq = seq
        return self._shard

    def _take(self) -> tuple[int, ShardBuilder]:
        """Detach the shard being filled for its commit."""
        shard, seq = self._shard, self._shard_seq
        assert shard is not None
        self._shard, self._shard_ids, self._shard_bytes = None, set(), 0
        return seq, shard

    def _drop_filling(self) -> None:
        """Drop the shard being filled after a failed write (its samples are lost)."""
        if self._shard is not None:
            seq, shard = self._take()
            self.lost += len(shard)
            shard.abort()

    def _commit(self, seq: int, shard: ShardBuilder) -> list[SampleRecord]:
        """Seal ``shard`` as shard ``seq``, then append and fsync its manifest records."""
        name = f"{seq:08d}.zarr"
        rel = f"shards/{self.writer_id}/{name}"
        try:
            written = self._publish(name, shard)
        except BaseException:
            shard.abort()
            self.lost += len(shard)
            raise
        lines: list[dict] = [
            {"op": "add", "id": sid, "shard": rel, "offset": off, "length": n, "checksum": crc}
            for sid, off, n, crc in written.rows
        ]
        lines.append(
            {
                "op": "commit",
                "shard": rel,
                "samples": len(written.rows),
                "tokens": written.tokens,
                "bytes": written.nbytes,
                "codec": self.header.codec,
            }
        )
        try:
            self._append(lines)
        except BaseException:
            self.lost += len(shard)
            raise
        self.store.refresh()
        return [SampleRecord(sid, rel, off, n, crc) for sid, off, n, crc in written.rows]

    def _wait_inflight(self) -> list[SampleRecord]:
        """Wait for the background commit; raises its error (its samples are then lost)."""
        if self._inflight is None:
            return []
        future, _n = self._inflight
        self._inflight = None
        with timer(self.phases, "wait_commit"):
            return future.result()

    def _flush_background(self) -> None:
        """Commit the shard being filled on the commit thread (at most one in flight) and go on."""
        self._wait_inflight()
        seq, shard = self._take()
        self._inflight = (self._committer.submit(self._commit, seq, shard), len(shard))

    def flush(self) -> list[SampleRecord]:
        """Commit the shard being filled now; returns the records committed (``[]`` if none).

        Also waits for a shard committing in the background (its records come first); when
        ``flush`` returns, every sample added so far is durable.
        """
        records = self._wait_inflight()
        if self._shard is None or not len(self._shard):
            return records
        seq, shard = self._take()
        return records + self._commit(seq, shard)

    def close(self) -> None:
        """Flush, then release the writer id. Safe to call twice."""
        if self._closed:
            return
        try:
            self.flush()
        finally:
            self._closed = True
            if self._shard is not None:  # a flush that raised before sealing it
                self._drop_filling()
            self._committer.shutdown()
            self._io_pool.shutdown()
            self._row_io.shutdown()
            self._close_target()

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
