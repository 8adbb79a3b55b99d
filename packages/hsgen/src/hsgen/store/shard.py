"""Reading sample rows back from a committed shard (writing one: :mod:`hsgen.store.shard_builder`)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import google_crc32c
import numpy as np

from hsgen.store import codecs as C
from hsgen.store.errors import StoreError
from hsgen.store.fsutil import read_exact_into
from hsgen.store.header import STORAGE_DTYPES, StoreHeader

SHARD_ATTR = "hsgen"
"""Key of the shard group's attributes that describe the shard (see ``docs/format.md``)."""


TARGET_IDS = "target_ids"
"""Per-token array of ``argmax`` stores: the verifier's greedy next token after each position."""


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
