"""The storage interface's contract, on both backends: a local directory and a real S3-compatible
server (moto's server mode, started by the tests)."""

from __future__ import annotations

import time

import pytest

from hsgen.store.backend import LocalBackend, ObjectBackend, is_remote, open_backend


@pytest.fixture(params=["local", "s3"])
def backend(request, tmp_path):
    if request.param == "local":
        return LocalBackend(tmp_path / "root")
    return ObjectBackend(request.getfixturevalue("s3_url"))


def test_put_get_and_replace(backend):
    backend.put("a/b/c.bin", b"hello")
    assert backend.get("a/b/c.bin") == b"hello"
    backend.put("a/b/c.bin", [b"new ", memoryview(b"bytes")])
    assert backend.get("a/b/c.bin") == b"new bytes"
    assert backend.size("a/b/c.bin") == 9
    assert abs(backend.mtime("a/b/c.bin") - time.time()) < 120


def test_missing_objects_name_themselves(backend):
    with pytest.raises(FileNotFoundError, match="nope"):
        backend.get("x/nope")
    with pytest.raises(FileNotFoundError, match="nope"):
        backend.size("x/nope")
    with pytest.raises(FileNotFoundError):
        backend.read_into("x/nope", memoryview(bytearray(4)), 0)
    backend.delete("x/nope")  # no error


def test_ranged_reads(backend):
    data = bytes(range(256)) * 64
    backend.put("blob", data)
    buf = bytearray(100)
    backend.read_into("blob", memoryview(buf), 1000)
    assert bytes(buf) == data[1000:1100]
    with pytest.raises(EOFError):
        backend.read_into("blob", memoryview(bytearray(10)), len(data) - 5)


def test_list_is_recursive_sorted_and_by_prefix(backend):
    for key in ("m/w2/00000001.jsonl", "m/w1/00000002.jsonl", "m/w1/00000001.jsonl", "s/x", "top"):
        backend.put(key, b"x")
    assert backend.list("m/") == ["m/w1/00000001.jsonl", "m/w1/00000002.jsonl", "m/w2/00000001.jsonl"]
    assert backend.list() == sorted(backend.list())
    assert "top" in backend.list() and "s/x" in backend.list()
    backend.delete("s/x")
    assert backend.list("s/") == []
    assert backend.list("nothing/") == []


def test_zarr_store_reads_what_the_backend_wrote(backend):
    import numpy as np
    import zarr

    arr = zarr.create_array(store=backend.zarr_store("g", read_only=False), name="a", shape=(10,), dtype="i4")
    arr[:] = np.arange(10)
    assert backend.list("g/a/")  # zarr's keys are the backend's keys
    again = zarr.open_array(store=backend.zarr_store("g"), path="a", mode="r")
    assert again[3:5].tolist() == [3, 4]


def test_open_backend_dispatches(tmp_path, s3_url):
    assert is_remote("s3://b/p") and not is_remote(str(tmp_path)) and not is_remote(tmp_path)
    assert isinstance(open_backend(tmp_path), LocalBackend)
    assert isinstance(open_backend(s3_url), ObjectBackend)
