"""Encodings of hidden states inside a shard, zarr v3 metadata, and sample checksums.

A shard holds each array in one zarr v3 array. ``hidden_states`` uses zarr's sharding codec
(one file, inner chunks of whole token rows, index at the end) so a reader fetches only the
rows it needs; the small per-token arrays are one plain chunk each. See ``docs/format.md``.
"""

from __future__ import annotations

import functools
import hashlib
import zlib
from collections.abc import Sequence
from typing import Any

import ml_dtypes
import numpy as np

from hsgen.store.header import LOGICAL_DTYPES, STORAGE_DTYPES

FP8_MAX = 448.0
"""Largest finite float8_e4m3fn value; the fp8 codec scales each token-layer vector to it."""

FP8_DTYPE = np.dtype(ml_dtypes.float8_e4m3fn)

DIMENSIONS = {
    "hidden_states": ["token", "layer", "hidden"],
    "hidden_scale": ["token", "layer"],
    "token_ids": ["token"],
    "loss_mask": ["token"],
    "target_ids": ["token"],
}

LZ4_BLOSC = {"cname": "lz4", "clevel": 5, "shuffle": "bitshuffle", "blocksize": 0}
"""Blosc settings of the ``lz4`` codec (typesize is the storage dtype's item size)."""

MISSING_CHUNK = np.uint64(2**64 - 1)
"""Sharding-index value marking an inner chunk that was never written (reads as fill value 0)."""


def hidden_storage_dtype(codec: str, dtype: str) -> np.dtype:
    """Dtype of the ``hidden_states`` zarr array for a codec and logical dtype."""
    return np.dtype(np.uint8) if codec == "fp8" else STORAGE_DTYPES[dtype]


def inner_chunk_tokens(tokens: int, row_bytes: int, chunk_bytes: int) -> int:
    """Token rows per inner chunk.

    Starts from ``c0 = clamp(chunk_bytes // row_bytes, 1, tokens)`` and picks the C in
    ``[max(1, c0 // 2), c0]`` that wastes the fewest padding rows (``ceil(tokens / C) * C - tokens``),
    the largest such C on ties.
    """
    c0 = max(1, min(tokens, chunk_bytes // max(1, row_bytes)))
    return min(range(max(1, c0 // 2), c0 + 1), key=lambda c: (-(-tokens // c) * c - tokens, -c))


def _bytes_codec() -> dict[str, Any]:
    return {"name": "bytes", "configuration": {"endian": "little"}}


def _array_meta(
    shape: list[int], chunk_shape: list[int], dtype: np.dtype, codecs: list, dims: list[str]
) -> dict:
    return {
        "shape": shape,
        "data_type": dtype.name,
        "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": chunk_shape}},
        "chunk_key_encoding": {"name": "default", "configuration": {"separator": "/"}},
        "fill_value": 0,
        "codecs": codecs,
        "attributes": {},
        "dimension_names": dims,
        "zarr_format": 3,
        "node_type": "array",
        "storage_transformers": [],
    }


def sharded_array_meta(tokens: int, inner_tokens: int, tail: list[int], dtype: np.dtype, lz4: bool) -> dict:
    """zarr.json of an array ``[tokens, *tail]`` stored as one shard of ``inner_tokens``-row chunks."""
    outer = -(-tokens // inner_tokens) * inner_tokens
    inner_codecs = [_bytes_codec()]
    if lz4:
        inner_codecs.append({"name": "blosc", "configuration": {"typesize": dtype.itemsize, **LZ4_BLOSC}})
    sharding = {
        "name": "sharding_indexed",
        "configuration": {
            "chunk_shape": [inner_tokens, *tail],
            "codecs": inner_codecs,
            "index_codecs": [_bytes_codec(), {"name": "crc32c"}],
            "index_location": "end",
        },
    }
    return _array_meta([tokens, *tail], [outer, *tail], dtype, [sharding], DIMENSIONS["hidden_states"])


def plain_array_meta(name: str, shape: list[int], dtype: np.dtype) -> dict:
    """zarr.json of an uncompressed array held in a single chunk (chunk key ``c/0[/0]``)."""
    return _array_meta(shape, shape, dtype, [_bytes_codec()], DIMENSIONS[name])


def group_meta(attributes: dict) -> dict:
    """zarr.json of the shard's root group."""
    return {"attributes": attributes, "zarr_format": 3, "node_type": "group"}


FP8_BLOCK_VALUES = 1 << 16
"""Values :func:`encode_fp8` takes per step: its working buffers (~0.7 MiB) stay in a core's L2."""


@functools.cache
def _fp8_table() -> np.ndarray:
    """The e4m3 byte of every float32, indexed by ``2 * (bits >> 16) + (bits & 0xFFFF != 0)``.

    Entry ``2t`` is ml_dtypes' cast of the float32 whose bits are ``t << 16`` (a bfloat16 value),
    entry ``2t + 1`` its cast of ``t << 16 | 1``. Every e4m3 rounding boundary (the midpoints
    between neighbours, the subnormal ones and the overflow one at 464 included) has at most
    5 significant bits, so it is a bfloat16 value: a float32 whose low 16 bits are not zero lies
    strictly between two neighbouring bfloat16 values with no boundary between them, and rounds as
    ``t << 16 | 1`` does. The table is therefore ml_dtypes' cast itself, bit for bit, for every
    non-NaN float32: checked once over all 2**32 patterns, and per top half with low halves 0, 1,
    0x7FFF, 0x8000, 0x8001, 0xFFFF in ``tests/hsgen/store/test_store_codecs_fp8.py``.
    """
    top = np.arange(1 << 16, dtype=np.uint32) << 16
    pairs = np.stack([top, top | 1], axis=1).reshape(-1)
    return pairs.view(np.float32).astype(FP8_DTYPE).view(np.uint8)


_F16_FAST_SCALE = np.float32(2.0**-14)
"""Smallest float16 scale whose product with 2**-112 is still a normal float32 (exact)."""

_MAGNITUDE = {  # storage dtype's unsigned view, the mask of its magnitude bits, its first non-finite
    "bfloat16": (np.uint16, 0x7FFF, 0x7F80),
    "float16": (np.uint16, 0x7FFF, 0x7C00),
    "float32": (np.uint32, 0x7FFFFFFF, 0x7F800000),
}


def encode_fp8(hidden: np.ndarray, dtype: str) -> tuple[np.ndarray, np.ndarray]:
    """Quantize storage-dtype hidden states ``[T, L, H]`` to e4m3 bytes and a ``[T, L]`` float32 scale.

    Each token-layer vector is divided (in float32) by ``max|x| / 448`` (1 when the vector is all
    zero) and rounded to e4m3 as ``astype(ml_dtypes.float8_e4m3fn)`` does, bit for bit, but several
    times faster (``scripts/bench_fp8_encode.py``): ``max|x|`` is an integer max of the magnitude
    bits, the rounding a lookup in :func:`_fp8_table`, and the work goes ``FP8_BLOCK_VALUES``
    values at a time through reused buffers.

    Raises:
        ValueError: a value is not finite.
    """
    shape = hidden.shape
    width = shape[-1]
    src = hidden.reshape(-1, width)
    n = src.shape[0]
    q = np.empty((n, width), dtype=np.uint8)
    scale = np.empty(n, dtype=np.float32)
    _encode_rows(src, q, scale, dtype, 0, n)
    return q.reshape(shape), scale.reshape(shape[:-1])


def _encode_rows(src: np.ndarray, q: np.ndarray, scale: np.ndarray, dtype: str, start: int, stop: int):
    """:func:`encode_fp8` of rows ``[start, stop)`` of ``src`` ``[N, H]`` into ``q`` and ``scale``."""
    width = src.shape[1]
    bits_type, mask, nonfinite = _MAGNITUDE[dtype]
    src_bits = src.view(bits_type)
    rows = max(1, FP8_BLOCK_VALUES // max(1, width))
    rows = min(rows, max(1, stop - start))
    x = np.empty((rows, width), dtype=np.float32)
    bits = x.view(np.uint32)
    index = np.empty((rows, width), dtype=np.uint32)
    magnitude = np.empty((rows, width), dtype=bits_type)
    table = _fp8_table()
    for r0 in range(start, stop, rows):
        r1 = min(stop, r0 + rows)
        k = r1 - r0
        xk, bk, ik, mk = x[:k], bits[:k], index[:k], magnitude[:k]
        np.bitwise_and(src_bits[r0:r1], mask, out=mk)
        top = mk.max(axis=1)
        if (top >= nonfinite).any():
            raise ValueError("fp8 codec needs finite hidden states; found inf or nan")
        if dtype == "bfloat16":
            amax = (top.astype(np.uint32) << 16).view(np.float32)
        else:
            amax = top.view(src.dtype).astype(np.float32)
        sk = np.where(amax > 0, amax / FP8_MAX, 1.0).astype(np.float32)
        scale[r0:r1] = sk
        if dtype == "bfloat16":  # bfloat16 -> float32 is the bits shifted up, exactly
            np.left_shift(src_bits[r0:r1], 16, out=bk, dtype=np.uint32)
            np.divide(xk, sk[:, None], out=xk)
        elif dtype == "float16" and (sk >= _F16_FAST_SCALE).all():
            # numpy's float16 cast is scalar; the bits moved into float32's fields are x * 2**-112
            # exactly (subnormals included), and so is the divisor: the same real quotient, the
            # same rounding. (Below _F16_FAST_SCALE the divisor would lose bits.)
            np.left_shift(src_bits[r0:r1], 16, out=bk, dtype=np.uint32)
            signed = bk.view(np.int32)
            signed >>= 3
            bk &= np.uint32(0x8FFFFFFF)
            np.divide(xk, (sk * np.float32(2.0**-112))[:, None], out=xk)
        else:
            np.divide(src[r0:r1], sk[:, None], out=xk, dtype=np.float32)
        # index 2 * (bits >> 16) + (low 16 bits != 0), without overflow for any bits
        np.right_shift(bk, 15, out=ik)
        bk &= np.uint32(0x7FFF)
        bk += np.uint32(0x7FFF)
        bk >>= 15
        ik |= bk
        np.take(table, ik, out=q[r0:r1], mode="clip")  # in range; "raise" would buffer


_FP8_TO_F32 = np.arange(256, dtype=np.uint8).view(FP8_DTYPE).astype(np.float32)
"""float32 value of each e4m3 byte (a table lookup is ~3x faster than an ml_dtypes cast)."""


def decode_fp8(q: np.ndarray, scale: np.ndarray, dtype: str) -> np.ndarray:
    """Inverse of :func:`encode_fp8`: storage-dtype hidden states ``[T, L, H]``."""
    x = _FP8_TO_F32[q.view(np.uint8)]
    x *= scale[..., None]
    return x.astype(LOGICAL_DTYPES[dtype]).view(STORAGE_DTYPES[dtype])


CHECKSUM_BLOCK_WORDS = 512
"""Words (uint64) per block of the ``bsum64`` checksum: 4 KiB, one page."""


class ChecksumStream:
    """A sample checksum fed piece by piece, so a reader can check bytes while they are hot in cache.

    Feed each array with :meth:`begin` (its total byte length) and then :meth:`update` calls
    covering its bytes in order; :meth:`hexdigest` after the last array equals
    :func:`checksum` of the whole arrays, however the bytes are cut into pieces (``bsum64``
    carries a block a piece leaves open into the next).
    """

    BLOCK = 8 * 512

    def __init__(self, algorithm: str = "bsum64"):
        if algorithm not in CHECKSUMS:
            raise ValueError(f"unknown checksum algorithm {algorithm!r} (known: {sorted(CHECKSUMS)})")
        self.algorithm = algorithm
        self._h = hashlib.blake2b(digest_size=8)
        self._xxh = None
        if algorithm == "xxh3":
            import xxhash

            self._xxh = xxhash.xxh3_64()
        self._crc = 0
        self._left = 0
        self._rows = np.zeros(0, dtype=np.uint64)  # one sum per whole block of the current array
        self._done = 0  # blocks summed so far
        self._cols: np.ndarray | None = None
        self._col = np.empty(CHECKSUM_BLOCK_WORDS, dtype=np.uint64)
        self._tail = b""

    def begin(self, nbytes: int) -> None:
        """Start the next array, of ``nbytes`` bytes."""
        self._finish()
        self._left = nbytes
        if self._xxh is not None:
            self._xxh.update(nbytes.to_bytes(8, "little"))
        elif self.algorithm == "bsum64":
            self._h.update(nbytes.to_bytes(8, "little"))
            self._cols = np.zeros(CHECKSUM_BLOCK_WORDS, dtype=np.uint64)
            self._rows = np.empty(nbytes // self.BLOCK, dtype=np.uint64)
            self._done = 0

    def update(self, data) -> None:
        """Feed the next bytes of the current array."""
        b = memoryview(data).cast("B")
        if len(b) > self._left:
            raise ValueError(f"{len(b)} bytes fed, {self._left} left in this array")
        self._left -= len(b)
        if self.algorithm == "crc32":
            self._crc = zlib.crc32(b, self._crc)
            return
        if self._xxh is not None:
            self._xxh.update(b)
            return
        if self._tail:  # complete the block the last piece left open
            take = min(len(b), self.BLOCK - len(self._tail))
            self._tail += bytes(b[:take])
            b = b[take:]
            if len(self._tail) == self.BLOCK:
                self._blocks(memoryview(self._tail))
                self._tail = b""
        full = len(b) // self.BLOCK
        if full:
            self._blocks(b[: full * self.BLOCK])
        if len(b) > full * self.BLOCK:
            self._tail = bytes(b[full * self.BLOCK :])

    def _blocks(self, b: memoryview) -> None:
        """Sum whole 4 KiB blocks into the row and column sums."""
        full = len(b) // self.BLOCK
        blocks = np.frombuffer(b, dtype="<u8").reshape(full, CHECKSUM_BLOCK_WORDS)
        np.add.reduce(blocks, axis=1, out=self._rows[self._done : self._done + full])
        np.add.reduce(blocks, axis=0, out=self._col)
        self._cols += self._col  # type: ignore[operator]
        self._done += full

    def _finish(self) -> None:
        if self._left:
            raise ValueError(f"array ended {self._left} bytes early")
        if self.algorithm == "bsum64" and self._cols is not None:
            if self._done:
                self._h.update(self._rows.astype("<u8", copy=False).tobytes())
                self._h.update(self._cols.astype("<u8", copy=False).tobytes())
            self._h.update(self._tail)
            self._cols, self._tail = None, b""

    def hexdigest(self) -> str:
        """The checksum string (``"xxh3:..."``, ``"bsum64:..."`` or ``"crc32:..."``) of everything fed."""
        self._finish()
        if self._xxh is not None:
            return f"xxh3:{self._xxh.hexdigest()}"
        if self.algorithm == "crc32":
            return f"crc32:{self._crc:08x}"
        return f"bsum64:{self._h.hexdigest()}"


def _stream(arrays: Sequence[np.ndarray], algorithm: str) -> str:
    s = ChecksumStream(algorithm)
    for a in arrays:
        b = memoryview(np.ascontiguousarray(a)).cast("B")
        s.begin(len(b))
        s.update(b)
    return s.hexdigest()


def _bsum64(arrays: Sequence[np.ndarray]) -> str:
    return _stream(arrays, "bsum64")


def _crc32(arrays: Sequence[np.ndarray]) -> str:
    return _stream(arrays, "crc32")


def _xxh3(arrays: Sequence[np.ndarray]) -> str:
    return _stream(arrays, "xxh3")


CHECKSUMS = {"xxh3": _xxh3, "bsum64": _bsum64, "crc32": _crc32}
"""Checksum algorithms by the prefix of their string form; readers accept all of them."""


def write_checksum(format_version: int) -> str:
    """The algorithm writers use in a store of ``format_version``: ``xxh3`` from version 2 (2-5x
    faster than ``bsum64``, see docs/benchmarks.md), ``bsum64`` in version 1 stores, so a store
    an older hsgen created stays verifiable by it after a newer one appended to it."""
    return "xxh3" if format_version >= 2 else "bsum64"


def checksum(arrays: Sequence[np.ndarray], algorithm: str = "bsum64") -> str:
    """Checksum string of the arrays' bytes, taken in order (C order, little endian).

    ``xxh3`` (what format-version-2 stores write): XXH3-64 (``xxhash``) over each array's byte
    length (8 bytes, little endian) followed by its bytes.
    ``bsum64`` (version 1 stores, ~4x faster than CRC-32 with numpy): each array contributes its byte
    length, the wrapping uint64 sums of every 4 KiB block (rows) and of every word position
    across blocks (columns), and its bytes past the last whole block, all fed to an 8-byte
    blake2b. Any change confined to one or two 8-byte words is always detected. ``crc32``: zlib
    CRC-32 of the concatenated bytes. See ``docs/format.md``.
    """
    try:
        return CHECKSUMS[algorithm](arrays)
    except KeyError:
        raise ValueError(f"unknown checksum algorithm {algorithm!r} (known: {sorted(CHECKSUMS)})") from None


def checksum_like(expected: str, arrays: Sequence[np.ndarray]) -> str:
    """Checksum of ``arrays`` with the algorithm named by ``expected``'s prefix."""
    return checksum(arrays, expected.split(":", 1)[0])


def sample_arrays(
    hidden: np.ndarray,
    token_ids: np.ndarray,
    loss_mask: np.ndarray,
    scale: np.ndarray | None = None,
    target_ids: np.ndarray | None = None,
) -> list[np.ndarray]:
    """The arrays a sample's checksum covers, in order: stored hidden rows, fp8 scale, ids, mask,
    and (``argmax`` stores) the verifier's target ids."""
    out = [hidden] + ([scale] if scale is not None else []) + [token_ids, loss_mask]
    return out + ([target_ids] if target_ids is not None else [])
