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

from .errors import StoreError
from .fsutil import fsync_dir
from .header import LOGICAL_DTYPES
from .manifest import MANIFEST_SUFFIX, ManifestAppender
from .records import SampleRecord
from .shard import PendingSample, WrittenShard, write_shard

if TYPE_CHECKING:
    from .store import HiddenStateStore

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

    When the buffer reaches ``shard_bytes``, ``add`` hands it to a background thread that
    writes the shard and its manifest records while the caller keeps adding (at most one shard
    in flight, so about ``2 * shard_bytes`` of arrays are held). ``add`` keeps a reference to
    the arrays (no copy): do not modify them in place before ``flush`` returns. A sample is
    durable only after ``flush`` (or ``close``) returns; an error of a background commit is
    raised by the next ``add``, ``flush`` or ``close``, and its samples stay buffered.
    """

    def __init__(
        self,
        store: HiddenStateStore,
        writer_id: str | None = None,
        *,
        shard_bytes: int = 32 << 20,
        chunk_bytes: int = 1 << 20,
        fsync: bool = True,
    ):
        """Open writer ``writer_id`` (default: a fresh unique id) of ``store``.

        Args:
            store: the store to add to.
            writer_id: names this writer's manifest and shard directory; reuse one to resume it.
            shard_bytes: commit a shard once buffered hidden states reach this size.
            chunk_bytes: size of zarr inner chunks inside a shard (the unit a compressed read fetches).
            fsync: fsync shards and manifest lines (turn off only for throwaway stores).

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
        self.header = store.header
        self._manifest: ManifestAppender | None = None
        self._pending: list[PendingSample] = []
        self._pending_ids: set[str] = set()
        self._pending_bytes = 0
        self._closed = False
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"hsgen-crc-{writer_id}")
        self._io_pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix=f"hsgen-fsync-{writer_id}")
        self._committer = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"hsgen-commit-{writer_id}")
        self._inflight: tuple[Future, list[PendingSample]] | None = None
        try:
            self._seq = self._open()
        except BaseException:
            self._pool.shutdown()
            self._io_pool.shutdown()
            self._committer.shutdown()
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

    def _write(self, name: str, batch: list[PendingSample]) -> WrittenShard:
        """Write shard ``name`` of this writer, complete (temp directory renamed into place)."""
        return self._write_shard(self._dir / name, self._dir / f"{name}.tmp-{secrets.token_hex(4)}", batch,
                                 fsync=self.fsync)  # fmt: skip

    def _write_shard(self, path: Path, tmp: Path, batch: list[PendingSample], *, fsync: bool) -> WrittenShard:
        """``batch`` as one complete shard at ``path`` (built in ``tmp``, renamed into place),
        with this writer's header, chunking and pools."""
        return write_shard(path, tmp, self.header, self.header.codec, batch, chunk_bytes=self.chunk_bytes,
                           pool=self._pool, io_pool=self._io_pool, fsync=fsync)  # fmt: skip

    def _append(self, lines: list[dict]) -> None:
        """Make the shard's manifest records durable."""
        assert self._manifest is not None
        self._manifest.append(lines, fsync=self.fsync)

    def _recover(self) -> int:
        """Remove this writer's leftovers of a crash; return the next shard sequence number."""
        self.store.refresh()
        committed = {n for n, s in self.store._replay.shards.items() if s.writer == self.writer_id}
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
        """Samples buffered or being committed in the background, not yet known durable."""
        inflight = 0
        if self._inflight is not None:
            if self._inflight[0].done() and self._inflight[0].exception() is None:
                self._inflight = None
            else:
                inflight = len(self._inflight[1])
        return len(self._pending) + inflight

    def add(
        self, sample_id: str, hidden_states: np.ndarray, token_ids, loss_mask=None, *, target_ids=None
    ) -> None:
        """Buffer one whole sample; writes a shard when the buffer reaches ``shard_bytes``.

        Args:
            sample_id: unique id of the sample.
            hidden_states: ``[T, n_layers, H]`` in the storage dtype (uint16 for bfloat16; an
                ml_dtypes bfloat16 array is accepted too).
            token_ids: ``[T]`` integer token ids.
            loss_mask: ``[T]`` 0/1 values; ``None`` means all ones.
            target_ids: ``[T]`` non-negative token ids, the verifier's greedy next token after
                each position: required by an ``argmax`` store, refused by any other.

        Raises:
            ValueError: a shape, dtype or value does not fit the store header.
        """
        if self._closed:
            raise StoreError(f"{self.store.path}: writer {self.writer_id} is closed")
        if not isinstance(sample_id, str) or not sample_id:
            raise ValueError(f"sample_id must be a non-empty string, got {sample_id!r}")
        if sample_id in self._pending_ids:
            raise ValueError(f"sample {sample_id!r} was already added to this writer")
        h = self.header
        hidden = np.asarray(hidden_states)
        if hidden.dtype == LOGICAL_DTYPES[h.dtype] and hidden.dtype != h.storage_dtype:
            hidden = hidden.view(h.storage_dtype)
        if hidden.dtype != h.storage_dtype:
            raise ValueError(
                f"sample {sample_id!r}: hidden_states dtype {hidden.dtype} does not match the store "
                f"({h.dtype}, stored as {h.storage_dtype})"
            )
        if hidden.ndim != 3 or hidden.shape[1:] != (h.num_layers, h.hidden_size) or hidden.shape[0] == 0:
            raise ValueError(
                f"sample {sample_id!r}: hidden_states shape {hidden.shape} must be "
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
        nbytes = hidden.nbytes
        if self._pending and self._pending_bytes + nbytes > self.shard_bytes:
            self._flush_background()
        self._pending.append(PendingSample(sample_id, np.ascontiguousarray(hidden), ids, mask, targets))
        self._pending_ids.add(sample_id)
        self._pending_bytes += nbytes
        if self._pending_bytes >= self.shard_bytes:
            self._flush_background()

    def _take(self) -> tuple[int, list[PendingSample]]:
        """Detach the buffer as the next shard's batch and give it a sequence number."""
        batch, seq = self._pending, self._seq
        self._seq += 1
        self._pending, self._pending_ids, self._pending_bytes = [], set(), 0
        return seq, batch

    def _untake(self, batch: list[PendingSample]) -> None:
        """Put a batch whose commit failed back at the front of the buffer (its sequence number stays used)."""
        self._pending[:0] = batch
        self._pending_ids.update(s.sample_id for s in batch)
        self._pending_bytes += sum(s.hidden.nbytes for s in batch)

    def _commit(self, seq: int, batch: list[PendingSample]) -> list[SampleRecord]:
        """Write ``batch`` as shard ``seq``, then append and fsync its manifest records."""
        name = f"{seq:08d}.zarr"
        rel = f"shards/{self.writer_id}/{name}"
        written = self._write(name, batch)
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
        self._append(lines)
        self.store.refresh()
        return [SampleRecord(sid, rel, off, n, crc) for sid, off, n, crc in written.rows]

    def _wait_inflight(self) -> list[SampleRecord]:
        """Wait for the background commit; on failure its samples return to the buffer and it raises."""
        if self._inflight is None:
            return []
        future, batch = self._inflight
        self._inflight = None
        try:
            return future.result()
        except BaseException:
            self._untake(batch)
            raise

    def _flush_background(self) -> None:
        """Commit the buffer on the commit thread (at most one shard in flight) and keep buffering."""
        self._wait_inflight()
        seq, batch = self._take()
        self._inflight = (self._committer.submit(self._commit, seq, batch), batch)

    def flush(self) -> list[SampleRecord]:
        """Commit the buffered samples as one shard now; returns their records (``[]`` if none).

        Also waits for a shard that ``add`` handed to the background (its records come first);
        when ``flush`` returns, every sample added so far is durable.
        """
        records = self._wait_inflight()
        if not self._pending:
            return records
        seq, batch = self._take()
        try:
            return records + self._commit(seq, batch)
        except BaseException:
            self._untake(batch)
            raise

    def close(self) -> None:
        """Flush, then release the writer id. Safe to call twice."""
        if self._closed:
            return
        try:
            self.flush()
        finally:
            self._closed = True
            self._committer.shutdown()
            self._pool.shutdown()
            self._io_pool.shutdown()
            self._close_target()

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
