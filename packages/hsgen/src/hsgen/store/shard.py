"""Writing one shard durably (temp directory, fsync, rename) and reading rows back from it."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Sequence
from concurrent.futures import Executor
from dataclasses import dataclass
from pathlib import Path

import google_crc32c
import numpy as np

from . import codecs as C
from .errors import StoreError
from .fsutil import failpoint, fsync_dir, fsync_tree, read_exact_into, tree_bytes, write_file
from .header import STORAGE_DTYPES, StoreHeader

SHARD_ATTR = "hsgen"
"""Key of the shard group's attributes that describe the shard (see ``docs/format.md``)."""


@dataclass
class PendingSample:
    """A sample buffered by a writer: arrays already validated and contiguous."""

    sample_id: str
    hidden: np.ndarray
    token_ids: np.ndarray
    loss_mask: np.ndarray
    target_ids: np.ndarray | None = None
    """``[T]`` int32 verifier argmax per token (``argmax`` stores only)."""


TARGET_IDS = "target_ids"
"""Per-token array of ``argmax`` stores: the verifier's greedy next token after each position."""


@dataclass
class WrittenShard:
    """What :func:`write_shard` committed to disk."""

    rows: list[tuple[str, int, int, str]]
    """(sample_id, offset, length, checksum) per sample, in shard order."""
    tokens: int
    nbytes: int


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


def _sharded_file_buffers(parts: Sequence[np.ndarray], tokens: int, inner: int, row_bytes: int) -> list:
    """Buffers of a sharding-codec file holding ``parts`` (rows concatenated), uncompressed."""
    n_chunks = -(-tokens // inner)
    pad = (n_chunks * inner - tokens) * row_bytes
    chunk = inner * row_bytes
    index = np.empty((n_chunks, 2), dtype="<u8")
    index[:, 0] = np.arange(n_chunks, dtype=np.uint64) * chunk
    index[:, 1] = chunk
    index_bytes = index.tobytes()
    crc = np.array([google_crc32c.value(index_bytes)], dtype="<u4").tobytes()
    buffers: list = [memoryview(p).cast("B") for p in parts]
    if pad:
        buffers.append(bytes(pad))
    buffers += [index_bytes, crc]
    return buffers


def write_shard(
    final: Path,
    tmp: Path,
    header: StoreHeader,
    codec: str,
    samples: Sequence[PendingSample],
    *,
    chunk_bytes: int,
    pool: Executor,
    io_pool: Executor | None = None,
    fsync: bool = True,
) -> WrittenShard:
    """Write ``samples`` as one shard at ``tmp``, fsync it, and rename it to ``final``.

    The shard appears at ``final`` only complete; a crash leaves at most ``tmp`` (removed by gc).
    Checksums run on ``pool`` while the data is written; the fsyncs of all files and directories
    of the shard are issued together on ``io_pool`` (the file system batches them).
    """
    if codec == "fp8":
        encoded = [C.encode_fp8(s.hidden, header.dtype) for s in samples]
        hidden_parts = [q for q, _ in encoded]
        scale_parts = [s for _, s in encoded]
    else:
        hidden_parts = [s.hidden for s in samples]
        scale_parts = []
    lengths = [len(s.token_ids) for s in samples]
    tokens = sum(lengths)
    dtype = C.hidden_storage_dtype(codec, header.dtype)
    tail = [header.num_layers, header.hidden_size]
    row_bytes = header.num_layers * header.hidden_size * dtype.itemsize
    inner = C.inner_chunk_tokens(tokens, row_bytes, chunk_bytes)

    def sums() -> list[str]:
        out = []
        for i, s in enumerate(samples):
            scale = scale_parts[i] if scale_parts else None
            arrays = C.sample_arrays(hidden_parts[i], s.token_ids, s.loss_mask, scale, s.target_ids)
            out.append(C.checksum(arrays, C.write_checksum(header.format_version)))
        return out

    future = pool.submit(sums)
    try:
        nbytes = 0
        hs_dir = tmp / "hidden_states"
        _mkdirs(tmp, "hidden_states", "c", "0", "0")
        hs_meta = C.sharded_array_meta(tokens, inner, tail, dtype, lz4=codec == "lz4")
        nbytes += write_file(hs_dir / "zarr.json", [_json_bytes(hs_meta)], fsync=False)
        if codec == "lz4":
            nbytes += _write_with_zarr(tmp, "hidden_states", np.concatenate(hidden_parts))
        else:
            buffers = _sharded_file_buffers(hidden_parts, tokens, inner, row_bytes)
            nbytes += write_file(hs_dir / "c" / "0" / "0" / "0", buffers, fsync=False)
        plain = [("token_ids", [s.token_ids for s in samples]), ("loss_mask", [s.loss_mask for s in samples])]
        if scale_parts:
            plain.append(("hidden_scale", scale_parts))
        if header.target_ids_stored:
            plain.append((TARGET_IDS, [s.target_ids for s in samples]))
        for name, parts in plain:
            shape = [tokens, *parts[0].shape[1:]]
            chunk_dir = tmp / name / "c"
            if len(shape) == 2:
                chunk_dir = chunk_dir / "0"
            _mkdirs(tmp, *chunk_dir.relative_to(tmp).parts)
            meta = C.plain_array_meta(name, shape, parts[0].dtype)
            nbytes += write_file(tmp / name / "zarr.json", [_json_bytes(meta)], fsync=False)
            nbytes += write_file(chunk_dir / "0", [memoryview(p).cast("B") for p in parts], fsync=False)
        checksums = future.result()
        rows, offset = [], 0
        for s, n, crc in zip(samples, lengths, checksums, strict=True):
            rows.append((s.sample_id, offset, n, crc))
            offset += n
        attrs = {
            SHARD_ATTR: {
                "format_version": header.format_version,
                "codec": codec,
                "dtype": header.dtype,
                "header": header.to_dict(),
                "samples": [list(r) for r in rows],
            }
        }
        nbytes += write_file(tmp / "zarr.json", [_json_bytes(C.group_meta(attrs))], fsync=False)
        if fsync:
            fsync_tree(tmp, io_pool)
        failpoint("shard_written")
        os.rename(tmp, final)
        if fsync:
            fsync_dir(final.parent)
        failpoint("shard_renamed")
    except BaseException:
        future.cancel()
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return WrittenShard(rows=rows, tokens=tokens, nbytes=nbytes)


def _write_with_zarr(group_dir: Path, name: str, data: np.ndarray) -> int:
    """Write ``data`` into an existing zarr array (metadata already on disk) with zarr's codecs."""
    import zarr
    from zarr.storage import LocalStore

    arr = zarr.open_array(store=LocalStore(group_dir), path=name, mode="r+")
    arr[...] = data
    return tree_bytes(group_dir / name / "c")


class LocalShardFiles:
    """The files of a shard on disk: descriptors opened once, read with ``preadv``."""

    remote = False

    def __init__(self, root: Path):
        self.root = root
        self._fds: dict[str, int] = {}

    def read_bytes(self, rel: str) -> bytes:
        return (self.root / rel).read_bytes()

    def _fd(self, rel: str) -> int:
        if rel not in self._fds:
            try:
                fd = os.open(self.root / rel, os.O_RDONLY)
            except FileNotFoundError as e:
                raise StoreError(f"{self.root / rel}: missing") from e
            if self._fds.setdefault(rel, fd) != fd:  # another thread opened it first
                os.close(fd)
        return self._fds[rel]

    def read_into(self, rel: str, view: memoryview, offset: int) -> None:
        read_exact_into(self._fd(rel), view, offset)

    def size(self, rel: str) -> int:
        return os.fstat(self._fd(rel)).st_size

    def zarr_store(self):
        from zarr.storage import LocalStore

        return LocalStore(self.root, read_only=True)

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


class ShardReader:
    """Reads sample rows from one committed shard.

    Uncompressed arrays are read with ``preadv`` straight into the result (only the sample's bytes);
    compressed ones go through zarr, which fetches only the inner chunks that overlap.
    """

    def __init__(self, root: Path, header: StoreHeader, files=None):
        """``files``: where the shard's bytes are (default: the directory ``root``); an object
        store's (:class:`hsgen.store.remote.ObjectShardFiles`) is read with ranged GETs."""
        self.root = root
        self.header = header
        self._files = files if files is not None else LocalShardFiles(root)
        try:
            attrs = json.loads(self._files.read_bytes("zarr.json"))["attributes"][SHARD_ATTR]
            self.codec = attrs["codec"]
            self.dtype = attrs["dtype"]
        except FileNotFoundError as e:
            raise StoreError(f"{root}: shard is missing ({e.filename})") from e
        except (ValueError, KeyError, TypeError) as e:
            raise StoreError(f"{root / 'zarr.json'}: not an hsgen shard ({e!r})") from e
        if self.dtype != header.dtype:
            raise StoreError(f"{root}: shard dtype {self.dtype!r} differs from the store's {header.dtype!r}")
        self.attrs = attrs
        self._meta: dict[str, dict] = {}
        self._index: np.ndarray | None = None
        self._zarr: dict[str, object] = {}
        self._rows_at: tuple[int, int] | None | bool = False  # _back_to_back(), once computed

    def close(self) -> None:
        """Close the open files."""
        self._files.close()
        self._zarr.clear()

    def meta(self, name: str) -> dict:
        """The parsed zarr.json of array ``name``."""
        if name not in self._meta:
            path = self.root / name / "zarr.json"
            try:
                self._meta[name] = json.loads(self._files.read_bytes(f"{name}/zarr.json"))
            except FileNotFoundError as e:
                raise StoreError(f"{path}: missing") from e
            except ValueError as e:
                raise StoreError(f"{path}: invalid JSON ({e})") from e
        return self._meta[name]

    def shape(self, name: str) -> tuple[int, ...]:
        """Shape of array ``name`` from its metadata."""
        return tuple(self.meta(name)["shape"])

    def _zarr_array(self, name: str):
        if name not in self._zarr:
            import zarr

            self._zarr[name] = zarr.open_array(store=self._files.zarr_store(), path=name, mode="r")
        return self._zarr[name]

    def _plain_fast(self, name: str) -> bool:
        m = self.meta(name)
        chunk = m["chunk_grid"]["configuration"]["chunk_shape"]
        return m["codecs"] == [C._bytes_codec()] and chunk == m["shape"]

    def _read_plain(self, name: str, offset: int, length: int, out: np.ndarray | None = None) -> np.ndarray:
        """Rows ``[offset, offset + length)`` of a per-token array; read straight into ``out``
        when given (C-contiguous, the array's dtype and row shape) and the array is one plain chunk."""
        m = self.meta(name)
        tail = m["shape"][1:]
        dtype = np.dtype(m["data_type"]).newbyteorder("<")
        if not self._plain_fast(name):
            got = np.asarray(self._zarr_array(name)[offset : offset + length])
            if out is None:
                return got
            out[...] = got
            return out
        if out is None or out.dtype != dtype or out.shape != (length, *tail) or not out.flags.c_contiguous:
            if out is not None:
                out[...] = self._read_plain(name, offset, length)
                return out
            out = np.empty([length, *tail], dtype=dtype)
        row = out.itemsize * int(np.prod(tail, dtype=np.int64))
        key = "/".join([name, "c"] + ["0"] * len(m["shape"]))
        self._files.read_into(key, memoryview(out).cast("B"), offset * row)
        return out

    def _hidden_layout(self) -> tuple[int, int] | None:
        """(inner chunk tokens, row bytes) when hidden states are uncompressed, else None."""
        m = self.meta("hidden_states")
        codecs = m["codecs"]
        if len(codecs) != 1 or codecs[0]["name"] != "sharding_indexed":
            return None
        conf = codecs[0]["configuration"]
        if conf["codecs"] != [C._bytes_codec()] or conf.get("index_location", "end") != "end":
            return None
        if conf["index_codecs"] not in ([C._bytes_codec()], [C._bytes_codec(), {"name": "crc32c"}]):
            return None
        outer = m["chunk_grid"]["configuration"]["chunk_shape"]
        if outer[1:] != m["shape"][1:] or conf["chunk_shape"][1:] != m["shape"][1:]:
            return None
        itemsize = np.dtype(m["data_type"]).itemsize
        return conf["chunk_shape"][0], itemsize * int(np.prod(m["shape"][1:], dtype=np.int64))

    def _back_to_back(self) -> tuple[int, int] | None:
        """(file offset of row 0, row bytes) when every hidden row of the shard lies in order in its
        file (uncompressed, every inner chunk full and right after the previous, as hsgen writes
        them), else None. Checked once per open shard, so a read needs no index lookup."""
        if self._rows_at is False:
            found = None
            layout = self._hidden_layout() if self.codec == "raw" else None
            if layout is not None:
                inner, row_bytes = layout
                index = self._ensure_index(inner)
                starts = index[:, 0].astype(np.int64)
                if (
                    len(index)
                    and (index[:, 1] == inner * row_bytes).all()
                    and (np.diff(starts) == inner * row_bytes).all()
                ):
                    found = (int(starts[0]), row_bytes)
            self._rows_at = found
        return self._rows_at  # type: ignore[return-value]

    def _load_index(self, n_chunks: int, with_crc: bool) -> np.ndarray:
        size = self._files.size("hidden_states/c/0/0/0")
        nbytes = 16 * n_chunks + (4 if with_crc else 0)
        buf = bytearray(nbytes)
        self._files.read_into("hidden_states/c/0/0/0", memoryview(buf), size - nbytes)
        if with_crc:
            want = int(np.frombuffer(bytes(buf[-4:]), dtype="<u4")[0])
            if google_crc32c.value(bytes(buf[:-4])) != want:
                raise StoreError(f"{self.root}/hidden_states/c/0/0/0: shard index checksum mismatch")
        return np.frombuffer(bytes(buf[: 16 * n_chunks]), dtype="<u8").reshape(n_chunks, 2)

    def _ensure_index(self, inner: int) -> np.ndarray:
        """The hidden-state file's sharding index (loaded once per open shard)."""
        if self._index is None:
            m = self.meta("hidden_states")
            outer = m["chunk_grid"]["configuration"]["chunk_shape"][0]
            with_crc = len(m["codecs"][0]["configuration"]["index_codecs"]) == 2
            self._index = self._load_index(outer // inner, with_crc)
        return self._index

    def _read_hidden(self, offset: int, length: int) -> np.ndarray:
        layout = self._hidden_layout()
        if layout is None:
            return np.asarray(self._zarr_array("hidden_states")[offset : offset + length])
        inner, row_bytes = layout
        m = self.meta("hidden_states")
        index = self._ensure_index(inner)
        out = np.empty([length, *m["shape"][1:]], dtype=np.dtype(m["data_type"]).newbyteorder("<"))
        view = memoryview(out).cast("B")
        first, last = offset // inner, (offset + length - 1) // inner
        chunk = inner * row_bytes
        spans = index[first : last + 1]
        if (spans[:, 1] == chunk).all() and (np.diff(spans[:, 0].astype(np.int64)) == chunk).all():
            self._files.read_into(
                "hidden_states/c/0/0/0", view, int(spans[0, 0]) + (offset - first * inner) * row_bytes
            )
            return out
        for k in range(first, last + 1):
            lo, hi = max(offset, k * inner), min(offset + length, (k + 1) * inner)
            dst = view[(lo - offset) * row_bytes : (hi - offset) * row_bytes]
            start, nbytes = index[k]
            if start == C.MISSING_CHUNK and nbytes == C.MISSING_CHUNK:
                dst[:] = bytes(len(dst))
            elif nbytes != chunk:
                return np.asarray(self._zarr_array("hidden_states")[offset : offset + length])
            else:
                self._files.read_into("hidden_states/c/0/0/0", dst, int(start) + (lo - k * inner) * row_bytes)
        return out

    def read(self, offset: int, length: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray | None]:
        """Stored arrays of rows ``[offset, offset + length)``: hidden, token_ids, loss_mask, scale.

        ``hidden`` is in the shard's stored form (uint8 e4m3 for fp8); ``scale`` is None unless fp8.
        """
        hidden = self._read_hidden(offset, length)
        scale = self._read_plain("hidden_scale", offset, length) if self.codec == "fp8" else None
        return (
            hidden,
            self._read_plain("token_ids", offset, length),
            self._read_plain("loss_mask", offset, length),
            scale,
        )

    def read_targets(self, offset: int, length: int, out: np.ndarray | None = None) -> np.ndarray | None:
        """The verifier's target ids ``[length]`` int32 of rows ``[offset, offset + length)``
        (into ``out`` when given), or None when the store keeps final-layer states instead."""
        if not self.header.target_ids_stored:
            return None
        return self._read_plain(TARGET_IDS, offset, length, out)

    def stored_arrays(self, offset: int, length: int) -> tuple[list[np.ndarray], np.ndarray | None]:
        """``(arrays, target_ids)`` of rows ``[offset, offset + length)``: the arrays in checksum
        order (:func:`hsgen.store.codecs.sample_arrays`), ``hidden, token_ids, loss_mask`` first."""
        hidden, token_ids, loss_mask, scale = self.read(offset, length)
        targets = self.read_targets(offset, length)
        return C.sample_arrays(hidden, token_ids, loss_mask, scale, targets), targets

    def read_into(
        self,
        offset: int,
        length: int,
        hidden: np.ndarray,
        token_ids: np.ndarray,
        loss_mask: np.ndarray,
        *,
        checksum: str | None = None,
        piece_bytes: int = 1 << 20,
        target_ids: np.ndarray | None = None,
    ) -> str | None:
        """Read rows ``[offset, offset + length)`` straight into the caller's arrays.

        ``hidden`` is ``[length, L, H]``, C-contiguous, in the storage dtype of the store's logical
        dtype (fp8 shards are decoded into it); ``token_ids`` ``[length]`` int64; ``loss_mask``
        ``[length]`` uint8. Uncompressed rows are read with ``preadv`` in pieces of
        ``piece_bytes``; with ``checksum`` (the manifest's string) each piece is checksummed right
        after it lands, while it is still in cache. Other layouts go through :meth:`read`. In an
        ``argmax`` store the target ids land in ``target_ids`` (``[length]`` int32; read and
        checked all the same when it is None).

        Returns:
            The checksum of the stored bytes (same algorithm as ``checksum``), or None without one.
        """
        want = (length, *self.shape("hidden_states")[1:])
        if tuple(hidden.shape) != want or not hidden.flags.c_contiguous:
            raise ValueError(f"hidden buffer {hidden.shape} is not a C-contiguous {want}")
        if hidden.dtype.itemsize != STORAGE_DTYPES[self.dtype].itemsize:
            raise ValueError(f"hidden buffer dtype {hidden.dtype} does not hold {self.dtype}")
        stream = C.ChecksumStream(checksum.split(":", 1)[0]) if checksum else None
        contiguous = None
        if length > 0:
            rows_at = self._back_to_back()
            if rows_at is not None:
                contiguous = rows_at[0] + offset * rows_at[1]
            elif self.codec == "raw" and (layout := self._hidden_layout()) is not None:
                inner, row_bytes = layout
                first, last = offset // inner, (offset + length - 1) // inner
                spans = self._ensure_index(inner)[first : last + 1]
                chunk = inner * row_bytes
                if (spans[:, 1] == chunk).all() and (np.diff(spans[:, 0].astype(np.int64)) == chunk).all():
                    contiguous = int(spans[0, 0]) + (offset - first * inner) * row_bytes
        if contiguous is not None:
            view = memoryview(hidden).cast("B")
            read = self._files.read_into
            if stream is None or self._files.remote:  # one read (a request per piece costs a round trip)
                read("hidden_states/c/0/0/0", view, contiguous)
            if stream is not None:
                step = max(
                    C.ChecksumStream.BLOCK, piece_bytes // C.ChecksumStream.BLOCK * C.ChecksumStream.BLOCK
                )
                stream.begin(len(view))
                update = stream.update
                for lo in range(0, len(view), step):
                    piece = view[lo : lo + step]
                    if not self._files.remote:
                        read("hidden_states/c/0/0/0", piece, contiguous + lo)
                    update(piece)  # while the piece is in cache
            extra: list[np.ndarray] = []
        else:
            stored, tokens, mask, scale = self.read(offset, length)
            targets = self.read_targets(offset, length, target_ids)
            np.copyto(hidden.view(STORAGE_DTYPES[self.dtype]), self.decode(stored, scale))
            np.copyto(token_ids, tokens)
            np.copyto(loss_mask, mask)
            if stream is None:
                return None
            return C.checksum_like(checksum, C.sample_arrays(stored, tokens, mask, scale, targets))
        for name, out in (("token_ids", token_ids), ("loss_mask", loss_mask)):
            extra.append(self._read_plain(name, offset, length, out))
        if self.header.target_ids_stored:
            extra.append(self._read_plain(TARGET_IDS, offset, length, target_ids))
        if stream is None:
            return None
        for a in extra:
            b = memoryview(np.ascontiguousarray(a)).cast("B")
            stream.begin(len(b))
            stream.update(b)
        return stream.hexdigest()

    def decode(self, hidden: np.ndarray, scale: np.ndarray | None) -> np.ndarray:
        """Stored hidden rows -> storage-dtype hidden states (dequantizes fp8)."""
        if self.codec == "fp8":
            return C.decode_fp8(hidden, scale, self.dtype)
        return (
            hidden.view(STORAGE_DTYPES[self.dtype]) if hidden.dtype != STORAGE_DTYPES[self.dtype] else hidden
        )
