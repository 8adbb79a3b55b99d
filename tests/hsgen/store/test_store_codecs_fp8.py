"""encode_fp8 gives the bytes of the plain ml_dtypes cast, bit for bit (issue 33, item 4)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from hsgen.store import codecs as C
from hsgen.store.header import LOGICAL_DTYPES, STORAGE_DTYPES


def reference_encode(hidden: np.ndarray, dtype: str) -> tuple[np.ndarray, np.ndarray]:
    """encode_fp8 as it was before issue 33: float32 copy, abs max, divide, ml_dtypes cast."""
    x = hidden.view(LOGICAL_DTYPES[dtype]).astype(np.float32)
    amax = np.abs(x).max(axis=-1)
    if not np.isfinite(amax).all():
        raise ValueError("fp8 codec needs finite hidden states; found inf or nan")
    scale = np.where(amax > 0, amax / C.FP8_MAX, 1.0).astype(np.float32)
    x /= scale[..., None]
    return x.astype(C.FP8_DTYPE).view(np.uint8), scale


def table_cast(x: np.ndarray) -> np.ndarray:
    """The e4m3 bytes of float32 ``x`` through the encoder's table and index."""
    bits = x.view(np.uint32)
    return C._fp8_table()[(bits >> 16) * 2 + ((bits & 0xFFFF) != 0)]


@pytest.mark.parametrize("low", [0, 1, 0x7FFF, 0x8000, 0x8001, 0xFFFF])
def test_table_is_the_ml_dtypes_cast_for_every_top_half(low):
    bits = (np.arange(1 << 16, dtype=np.uint32) << 16) | np.uint32(low)
    x = bits.view(np.float32)
    want = x.astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    got = table_cast(x)
    # NaN inputs map to some NaN byte either way; every other float32 to the same byte
    finite = np.isfinite(x)
    np.testing.assert_array_equal(got[finite], want[finite])
    assert np.isnan(got[~finite].view(ml_dtypes.float8_e4m3fn)).all()


def test_table_is_the_ml_dtypes_cast_on_dense_low_bits_around_every_e4m3_boundary():
    values = np.arange(256, dtype=np.uint8).view(C.FP8_DTYPE).astype(np.float32)
    values = np.unique(values[np.isfinite(values)])
    mids = np.concatenate([(values[1:] + values[:-1]) / 2, [464.0, -464.0], values])
    top = mids.view(np.uint32)[:, None] & np.uint32(0xFFFF0000)
    tops = np.concatenate([top - np.uint32(1 << 16), top, top + np.uint32(1 << 16)])
    low = np.arange(0, 1 << 16, 97, dtype=np.uint32)
    x = (tops | low).reshape(-1).view(np.float32)
    x = x[np.isfinite(x)]
    np.testing.assert_array_equal(table_cast(x), x.astype(C.FP8_DTYPE).view(np.uint8))


def storage(values: np.ndarray, dtype: str) -> np.ndarray:
    return values.astype(LOGICAL_DTYPES[dtype]).view(STORAGE_DTYPES[dtype])


def assert_same(hidden: np.ndarray, dtype: str) -> None:
    q, scale = C.encode_fp8(hidden, dtype)
    want_q, want_scale = reference_encode(hidden, dtype)
    assert q.dtype == np.uint8 and q.shape == hidden.shape
    assert scale.dtype == np.float32 and scale.shape == hidden.shape[:-1]
    np.testing.assert_array_equal(scale, want_scale)
    np.testing.assert_array_equal(q, want_q)


@pytest.mark.parametrize("dtype", sorted(LOGICAL_DTYPES))
@pytest.mark.parametrize(
    "shape", [(1, 1, 1), (3, 2, 8), (7, 4, 1024), (200, 3, 333), (5, 1, 70000), (0, 4, 16), (2, 2, 65536)]
)
def test_encode_matches_the_old_encode_on_random_data(dtype, shape):
    rng = np.random.default_rng(hash((dtype, shape)) % 2**32)
    scales = 10.0 ** rng.uniform(-6, 4, size=shape[:-1] + (1,))
    values = rng.standard_normal(shape) * scales
    assert_same(storage(values, dtype), dtype)


@pytest.mark.parametrize("dtype", sorted(LOGICAL_DTYPES))
def test_encode_matches_on_edge_vectors(dtype):
    info = np.finfo(LOGICAL_DTYPES[dtype])
    rows = [
        np.zeros(16),
        -np.zeros(16),
        np.full(16, 448.0),
        np.full(16, -448.0),
        np.linspace(-448, 448, 16),
        np.array([float(info.max), -float(info.max)] + [float(info.max) / 3] * 14),
        np.array([float(info.smallest_subnormal)] * 8 + [0.0] * 8),
        np.array([float(info.smallest_subnormal), -float(info.smallest_normal)] + [1.0] * 14),
        np.array([448.0] + [1.0 + k / 16 for k in range(15)]),  # scale 1: e4m3 ties, normal
        np.array([448.0] + [k * 2.0**-10 for k in range(15)]),  # and subnormal
    ]
    hidden = storage(np.stack(rows)[:, None, :], dtype)
    assert_same(hidden, dtype)
    q, scale = C.encode_fp8(hidden, dtype)
    assert (q[0] == 0).all() and (q[1] == 0x80).all() and (scale[:2] == 1).all()
    assert (q[2] == 0x7E).all() and (q[3] == 0xFE).all()


@pytest.mark.parametrize("dtype", sorted(LOGICAL_DTYPES))
def test_encode_on_every_storage_value(dtype):
    """Every 16-bit pattern as a value (or, for float32, every top half with a few low halves)."""
    bits = np.arange(1 << 16, dtype=np.uint32)
    if dtype == "float32":
        bits = np.concatenate([(bits << 16) | np.uint32(low) for low in (0, 1, 0x8000, 0xFFFF)])
        values = bits.view(np.float32)
    else:
        values = bits.astype(np.uint16).view(LOGICAL_DTYPES[dtype]).astype(np.float32)
    values = values[np.isfinite(values)]
    rng = np.random.default_rng(1)
    for maximum in (448.0, 1.0, float(np.abs(values).max())):
        kept = values[np.abs(values) <= maximum]
        rng.shuffle(kept)
        width = 512
        kept = kept[: len(kept) // width * width].reshape(-1, 1, width)
        kept[:, 0, 0] = maximum  # the same scale for every vector
        assert_same(storage(kept, dtype), dtype)


@pytest.mark.parametrize("dtype", sorted(LOGICAL_DTYPES))
@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan])
def test_encode_refuses_non_finite(dtype, bad):
    values = np.ones((3, 2, 100))
    values[2, 1, 57] = bad
    with pytest.raises(ValueError, match="finite"):
        C.encode_fp8(storage(values, dtype), dtype)


def test_encode_takes_strided_input():
    values = np.random.default_rng(3).standard_normal((6, 4, 64))
    hidden = storage(values, "bfloat16")[::2, ::-1]
    assert_same(hidden, "bfloat16")


def test_float16_scales_around_the_fast_path_threshold():
    """float16 rows whose scale is just above, at and just below 2**-14 (the exact-divisor bound)."""
    at = np.float16(448 * 2.0**-14)
    amaxes = [np.nextafter(at, np.float16(0)), at, np.nextafter(at, np.float16(1)), np.float16(0.5)]
    rng = np.random.default_rng(5)
    subnormals = np.arange(1, 1024, dtype=np.uint16).view(np.float16)
    rows = []
    for amax in amaxes:
        row = rng.uniform(-float(amax), float(amax), 2048).astype(np.float16)
        row[:1023] = subnormals * np.where(rng.random(1023) < 0.5, -1, 1).astype(np.float16)
        row[-1] = amax
        rows.append(row)
    hidden = np.stack(rows)[:, None, :]
    assert_same(hidden, "float16")
    for i in range(len(rows)):  # one row at a time: each block on its own path
        assert_same(hidden[i : i + 1], "float16")
