"""One shard being written: each sample's rows land in the shard's temporary directory as the
sample is added, and the shard is sealed complete (index, metadata, fsync, rename) when full.

A sample's hidden states are written once, from where they are: an array, or the rows still in
the server's file (:class:`hsgen.client.hidden_file.FileRows`), read a piece at a time straight into a
staging buffer that is reused for every sample. Each piece is checked (finite values, when asked)
and fed to the sample's checksum while it is in cache: the bytes checked are the bytes stored.
Full blocks of the staging buffer are written with ``O_DIRECT`` where the file system takes it
(ext4, xfs; tmpfs does not, and gets ordinary writes): the rows then take no page cache, so
writing them touches no memory but the staging buffer's. On this project's machine, a VM whose
freed memory goes back to the host and costs 5-20x more to touch again, that is what decides
whether the landing keeps up with a raw copy of the same bytes (``docs/benchmarks.md``). An
``lz4`` shard is written by zarr at the seal from the arrays kept until then.

The temporary directory becomes the shard only by the rename at the seal, after its fsync; a
crash before it leaves a ``.tmp-`` directory that the writer's recovery or ``hsgen gc`` removes.
"""

from __future__ import annotations

import errno
import json
import mmap
import os
import shutil
import time
from concurrent.futures import Executor, Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import google_crc32c
import numpy as np

from hsgen.client.phases import PhaseTimes, timer
from hsgen.store import codecs as C
from hsgen.store.errors import SampleRejected
from hsgen.store.fsutil import (
    failpoint,
    fsync_dir,
    fsync_tree,
    pwrite_all,
    read_exact_into,
    tree_bytes,
    write_file,
)
from hsgen.store.header import StoreHeader
from hsgen.store.shard import SHARD_ATTR, TARGET_IDS

PIECE_BYTES = 1 << 20
"""Bytes read, checked and checksummed at a time (they stay in a core's cache in between)."""

BLOCK_BYTES = 4 << 20
"""Bytes of the staging buffer written at once (a multiple of any file system's direct-I/O
alignment; 1 MiB direct writes kept the disk less busy on this machine, 4 and 8 MiB did not)."""


@dataclass
class WrittenShard:
    """What :meth:`ShardBuilder.seal` committed to disk."""

    rows: list[tuple[str, int, int, str]]
    """(sample_id, offset, length, checksum) per sample, in shard order."""
    tokens: int
    nbytes: int


@dataclass
class _Added:
    """A sample in the shard: its small arrays (written at the seal) and its checksum."""

    sample_id: str
    token_ids: np.ndarray
    loss_mask: np.ndarray
    checksum: str
    scale: np.ndarray | None = None
    target_ids: np.ndarray | None = None
    hidden: np.ndarray | None = None  # lz4 only: written by zarr at the seal


def _mkdirs(root: Path, *parts: str) -> None:
    """Create ``root`` and each nested part that does not exist yet (one mkdir per new level)."""
    path = str(root)
    if not os.path.isdir(path):
        os.mkdir(path)
    for part in parts:
        path = os.path.join(path, part)
        if not os.path.isdir(path):
            os.mkdir(path)


def _json_bytes(obj: dict) -> bytes:
    return json.dumps(obj, indent=2).encode() + b"\n"


def _index_tail(tokens: int, inner: int, row_bytes: int) -> list[bytes]:
    """What follows the rows in a sharding-codec file: the last chunk's padding, the index, its crc32c."""
    n_chunks = -(-tokens // inner)
    chunk = inner * row_bytes
    index = np.empty((n_chunks, 2), dtype="<u8")
    index[:, 0] = np.arange(n_chunks, dtype=np.uint64) * chunk
    index[:, 1] = chunk
    index_bytes = index.tobytes()
    crc = np.array([google_crc32c.value(index_bytes)], dtype="<u4").tobytes()
    pad = (n_chunks * inner - tokens) * row_bytes
    return [bytes(pad), index_bytes, crc]


class _RowFile:
    """The hidden-state file's rows, written in aligned blocks through two staging buffers: one
    is filled while the other is written (``O_DIRECT`` when the file system takes it) on
    ``io``'s thread. The bytes past the last full block and the sharding index are written at the
    end through an ordinary descriptor."""

    def __init__(self, path: Path, staging: tuple[memoryview, memoryview], io: Executor | None,
                 phases: PhaseTimes | None, direct: bool = True):  # fmt: skip
        self.path = path
        self.staging = staging
        self.block = len(staging[0])
        self.io = io
        self.phases = phases
        self.pos = 0  # rows' bytes so far
        self.flushed = 0  # of them, handed to a write (a multiple of the block size)
        self._cur = 0  # the staging buffer being filled
        self._pending: Future | None = None  # the other one's write
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
        self._direct = -1
        flag = getattr(os, "O_DIRECT", 0) if direct else 0
        if flag:
            try:
                self._direct = os.open(path, os.O_WRONLY | flag)
            except OSError:  # a file system without direct I/O: ordinary writes
                self._direct = -1

    @property
    def fill(self) -> int:
        return self.pos - self.flushed

    def space(self, most: int) -> memoryview:
        """Where the next bytes go: at most ``most``, up to the end of the staging buffer."""
        return self.staging[self._cur][self.fill : self.fill + min(most, self.block - self.fill)]

    def advance(self, n: int) -> None:
        """``n`` bytes were put in :meth:`space`; a full staging buffer goes to be written."""
        self.pos += n
        if self.fill < self.block:
            return
        self.wait()  # the other buffer is free again once its write is done
        data, offset = self.staging[self._cur], self.flushed
        if self.io is None:
            self._write(data, offset)
        else:
            self._pending = self.io.submit(self._write, data, offset)
        self.flushed = self.pos
        self._cur ^= 1

    def wait(self) -> None:
        """Wait for the write in flight; raises its error."""
        pending, self._pending = self._pending, None
        if pending is not None:
            with timer(self.phases, "write_wait"):
                pending.result()

    def _write(self, data: memoryview, offset: int) -> None:
        with timer(self.phases, "write"):
            if self._direct >= 0:
                try:
                    pwrite_all(self._direct, data, offset)
                    failpoint("rows_block_written")
                    return
                except OSError as e:
                    if e.errno != errno.EINVAL:  # alignment the file system wants otherwise: write as usual
                        raise
                    os.close(self._direct)
                    self._direct = -1
            pwrite_all(self._fd, data, offset)

    def rollback(self, pos: int) -> None:
        """Forget every byte from ``pos`` on (a rejected sample's)."""
        self.wait()
        block = pos - pos % self.block
        if block < self.flushed:  # bytes of the block holding ``pos`` were written out: read them back
            read_exact_into(self._fd, self.staging[self._cur][: pos - block], block)
        self.pos, self.flushed = pos, min(self.flushed, block)

    def finish(self, tail: list[bytes]) -> int:
        """Write the rest and ``tail``; returns the file's size."""
        self.wait()
        with timer(self.phases, "write"):
            pwrite_all(self._fd, bytes(self.staging[self._cur][: self.fill]) + b"".join(tail), self.flushed)
        size = self.pos + sum(map(len, tail))
        os.ftruncate(self._fd, size)  # what a rollback left past the end
        self.close()
        return size

    def close(self) -> None:
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.exception()  # wait: the buffer is not to be reused under a write
        for fd in (self._direct, self._fd):
            if fd >= 0:
                os.close(fd)
        self._direct = self._fd = -1


class ShardBuilder:
    """The shard being filled at ``tmp`` (see the module docstring). One thread at a time.

    Args:
        tmp: the temporary directory (must not exist).
        header: the store's header (codec, dtype, shape, format version).
        chunk_bytes: size of zarr inner chunks.
        staging: two buffers of :data:`BLOCK_BYTES`, page-aligned (:func:`staging_buffers`),
            that the writer hands every other shard it builds (None: the builder maps its own).
        io: the thread that writes a full staging buffer while the other fills (None: written
            at once).
        direct: write the rows with ``O_DIRECT`` where the file system takes it (for a store
            that is fsync'd anyway; a throwaway or staged shard is better off in the page cache).
        phases: where the time of each phase is added (None: not timed).
    """

    def __init__(self, tmp: Path, header: StoreHeader, *, chunk_bytes: int,
                 staging: tuple[memoryview, memoryview] | None = None, io: Executor | None = None,
                 direct: bool = True, phases: PhaseTimes | None = None):  # fmt: skip
        self.tmp = tmp
        self.header = header
        self.codec = header.codec
        self.chunk_bytes = chunk_bytes
        self.phases = phases
        self.samples: list[_Added] = []
        self.tokens = 0
        self.dtype = C.hidden_storage_dtype(self.codec, header.dtype)
        self.row_bytes = header.num_layers * header.hidden_size * self.dtype.itemsize
        self.algorithm = C.write_checksum(header.format_version)
        self._rows: _RowFile | None = None
        _mkdirs(tmp, "hidden_states", "c", "0", "0")
        if self.codec != "lz4":
            self._rows = _RowFile(self._hidden_file, staging or staging_buffers(), io, phases, direct)

    @property
    def _hidden_file(self) -> Path:
        return self.tmp / "hidden_states" / "c" / "0" / "0" / "0"

    def __len__(self) -> int:
        return len(self.samples)

    # ------------------------------------------------------------------ adding

    def add(self, sample_id: str, hidden: Any, token_ids: np.ndarray, loss_mask: np.ndarray,
            target_ids: np.ndarray | None = None, *, check_finite: bool = False) -> None:  # fmt: skip
        """Append one sample (arrays already checked against the header; ``hidden`` an array in
        the storage dtype or :class:`~hsgen.client.hidden_file.FileRows`).

        Raises:
            SampleRejected: ``check_finite`` and a value is not finite, or the rows' file is
                shorter than it said; nothing of the sample is kept.
            OSError: a write failed (a full disk): the builder is unusable, :meth:`abort` it.
        """
        stream = C.ChecksumStream(self.algorithm)
        scale = kept = None
        if self.codec == "raw":
            self._write_rows(stream, hidden, sample_id, check_finite)
        else:
            rows = self._whole(hidden, sample_id)
            if check_finite:
                self._check_finite(rows, sample_id)
            if self.codec == "fp8":
                with timer(self.phases, "encode"):
                    rows, scale = C.encode_fp8(rows, self.header.dtype)
                self._write_rows(stream, rows, sample_id, False)
            else:
                kept = rows
                with timer(self.phases, "checksum"):
                    stream.begin(rows.nbytes)
                    stream.update(memoryview(np.ascontiguousarray(rows)).cast("B"))
        with timer(self.phases, "checksum"):
            for a in (scale, token_ids, loss_mask, target_ids):
                if a is not None:
                    b = memoryview(np.ascontiguousarray(a)).cast("B")
                    stream.begin(len(b))
                    stream.update(b)
        n = int(token_ids.shape[0])
        self.samples.append(
            _Added(sample_id, token_ids, loss_mask, stream.hexdigest(), scale, target_ids, kept)
        )
        self.tokens += n

    def _whole(self, hidden: Any, sample_id: str) -> np.ndarray:
        """The rows as an array in memory (read from their file if they are still there)."""
        if isinstance(hidden, np.ndarray):
            return hidden
        with timer(self.phases, "read"):
            try:
                return np.asarray(hidden)
            except (EOFError, OSError, ValueError) as e:
                raise SampleRejected(
                    f"sample {sample_id!r}: its rows cannot be read ({e})", "truncated_file"
                ) from None

    def _check_finite(self, rows: np.ndarray, sample_id: str) -> None:
        from hsgen.protocol.dtypes import all_finite

        with timer(self.phases, "check_finite"):
            if not all_finite(rows, self.header.dtype):
                raise SampleRejected(f"sample {sample_id!r}: hidden states contain NaN or Inf", "non_finite")

    def _write_rows(self, stream: C.ChecksumStream, rows: Any, sample_id: str, check_finite: bool) -> None:
        """Read the stored rows piece by piece into the staging buffer, check and checksum each
        piece there, and write the buffer out as it fills; a rejected sample leaves nothing."""
        from hsgen.protocol.dtypes import all_finite

        out = self._rows
        assert out is not None
        phases, dtype, logical = self.phases, self.dtype, self.header.dtype
        total = int(rows.nbytes)
        src = memoryview(np.ascontiguousarray(rows)).cast("B") if isinstance(rows, np.ndarray) else None
        start = out.pos
        stream.begin(total)
        done = 0
        try:
            while done < total:
                t0 = time.perf_counter()
                piece = out.space(min(PIECE_BYTES, total - done))
                try:
                    if src is not None:
                        piece[:] = src[done : done + len(piece)]
                    else:
                        rows.read_range(piece, done)
                except (EOFError, OSError, ValueError) as e:
                    raise SampleRejected(
                        f"sample {sample_id!r}: its rows cannot be read ({e})", "truncated_file"
                    ) from None
                t1 = time.perf_counter()
                if check_finite and not all_finite(np.frombuffer(piece, dtype=dtype), logical):
                    raise SampleRejected(
                        f"sample {sample_id!r}: hidden states contain NaN or Inf", "non_finite"
                    )
                t2 = time.perf_counter()
                stream.update(piece)
                t3 = time.perf_counter()
                done += len(piece)
                out.advance(len(piece))
                if phases is not None:
                    phases.add("read", t1 - t0)
                    phases.add("check_finite", t2 - t1)
                    phases.add("checksum", t3 - t2)
        except SampleRejected:
            out.rollback(start)
            raise

    # ------------------------------------------------------------------ sealing

    def seal(self, final: Path, *, fsync: bool = True, io_pool: Executor | None = None) -> WrittenShard:
        """Complete the shard (index, the per-token arrays, metadata), fsync it and rename it to
        ``final``; the builder is done after it (also when it raises: its directory is removed)."""
        if not self.samples:
            raise ValueError("an empty shard is never sealed")
        try:
            with timer(self.phases, "seal"):
                nbytes = self._finish()
            if fsync:
                with timer(self.phases, "fsync_files"):
                    fsync_tree(self.tmp, io_pool)
            failpoint("shard_written")
            with timer(self.phases, "rename_fsync_dir"):
                os.rename(self.tmp, final)
                if fsync:
                    fsync_dir(final.parent)
            failpoint("shard_renamed")
        except BaseException:
            self.abort()
            raise
        rows, offset = [], 0
        for s in self.samples:
            n = int(s.token_ids.shape[0])
            rows.append((s.sample_id, offset, n, s.checksum))
            offset += n
        return WrittenShard(rows=rows, tokens=self.tokens, nbytes=nbytes)

    def _finish(self) -> int:
        """Write everything but the rows; returns the shard's bytes."""
        h, tmp, tokens = self.header, self.tmp, self.tokens
        tail = [h.num_layers, h.hidden_size]
        inner = C.inner_chunk_tokens(tokens, self.row_bytes, self.chunk_bytes)
        hs_meta = C.sharded_array_meta(tokens, inner, tail, self.dtype, lz4=self.codec == "lz4")
        nbytes = write_file(tmp / "hidden_states" / "zarr.json", [_json_bytes(hs_meta)], fsync=False)
        if self.codec == "lz4":
            nbytes += _write_with_zarr(tmp, "hidden_states", np.concatenate([s.hidden for s in self.samples]))
        else:
            assert self._rows is not None
            with timer(self.phases, "write"):
                nbytes += self._rows.finish(_index_tail(tokens, inner, self.row_bytes))
        plain = [
            ("token_ids", [s.token_ids for s in self.samples]),
            ("loss_mask", [s.loss_mask for s in self.samples]),
        ]
        if self.codec == "fp8":
            plain.append(("hidden_scale", [s.scale for s in self.samples]))
        if h.target_ids_stored:
            plain.append((TARGET_IDS, [s.target_ids for s in self.samples]))
        for name, parts in plain:
            shape = [tokens, *parts[0].shape[1:]]
            chunk_dir = tmp / name / "c"
            if len(shape) == 2:
                chunk_dir = chunk_dir / "0"
            _mkdirs(tmp, *chunk_dir.relative_to(tmp).parts)
            meta = C.plain_array_meta(name, shape, parts[0].dtype)
            nbytes += write_file(tmp / name / "zarr.json", [_json_bytes(meta)], fsync=False)
            nbytes += write_file(chunk_dir / "0", [memoryview(np.ascontiguousarray(p)).cast("B") for p in parts],
                                 fsync=False)  # fmt: skip
        rows, offset = [], 0
        for s in self.samples:
            n = int(s.token_ids.shape[0])
            rows.append([s.sample_id, offset, n, s.checksum])
            offset += n
        attrs = {
            SHARD_ATTR: {
                "format_version": h.format_version,
                "codec": self.codec,
                "dtype": h.dtype,
                "header": h.to_dict(),
                "samples": rows,
            }
        }
        nbytes += write_file(tmp / "zarr.json", [_json_bytes(C.group_meta(attrs))], fsync=False)
        return nbytes

    def abort(self) -> None:
        """Drop the shard: close its file, remove its directory."""
        if self._rows is not None:
            self._rows.close()
        shutil.rmtree(self.tmp, ignore_errors=True)


def staging_buffers() -> tuple[memoryview, memoryview]:
    """Two page-aligned buffers of :data:`BLOCK_BYTES` (what ``O_DIRECT`` needs), for one shard at a time."""
    return memoryview(mmap.mmap(-1, BLOCK_BYTES)), memoryview(mmap.mmap(-1, BLOCK_BYTES))


def _write_with_zarr(group_dir: Path, name: str, data: np.ndarray) -> int:
    """Write ``data`` into an existing zarr array (metadata already on disk) with zarr's codecs."""
    import zarr
    from zarr.storage import LocalStore

    arr = zarr.open_array(store=LocalStore(group_dir), path=name, mode="r+")
    arr[...] = data
    return tree_bytes(group_dir / name / "c")


__all__ = ["BLOCK_BYTES", "PIECE_BYTES", "ShardBuilder", "WrittenShard", "staging_buffers"]
