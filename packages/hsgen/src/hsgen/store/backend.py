"""Where a store's bytes live: a small interface over a local directory or an object store.

A store on a POSIX path keeps its own fast paths (``preadv``, ``flock``, append-only manifests);
a store at ``s3://bucket/prefix`` goes through :class:`ObjectBackend`, which is zarr's own
``zarr.storage.ObjectStore`` over obstore's S3 client (credentials, region and endpoint from
the standard ``AWS_*`` variables: ``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``,
``AWS_SESSION_TOKEN``, ``AWS_REGION`` / ``AWS_DEFAULT_REGION``, ``AWS_ENDPOINT_URL``).
:class:`LocalBackend` offers the same interface on a directory, so the object-store code and the
conformance suite (``tests/hsgen/store/test_backend.py``) run on both.

Every ``put`` is atomic: a reader sees the whole object or none (a temp file renamed into place
on disk, one PUT on an object store). Nothing here renames or appends on an object store; the
store's layout there is built for that (see ``docs/format.md``).
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

from hsgen.store.errors import StoreError

REMOTE_SCHEMES = ("s3://",)


def is_remote(location: Any) -> bool:
    """Whether ``location`` names an object store (``s3://bucket/prefix``) rather than a path."""
    return isinstance(location, str) and location.startswith(REMOTE_SCHEMES)


class Backend(Protocol):
    """The bytes of one store, addressed by ``/``-separated keys relative to its root."""

    url: str
    remote: bool

    def get(self, key: str) -> bytes:
        """The whole object (``FileNotFoundError`` naming it when absent)."""
        ...

    def read_into(self, key: str, view: memoryview, offset: int) -> None:
        """Fill ``view`` from ``key`` at byte ``offset`` (``EOFError`` when the object is shorter)."""
        ...

    def size(self, key: str) -> int: ...

    def mtime(self, key: str) -> float:
        """When ``key`` was last written (seconds since the epoch)."""
        ...

    def put(self, key: str, data: bytes | Sequence[bytes | memoryview]) -> None:
        """Write ``key`` atomically (replacing it)."""
        ...

    def list(self, prefix: str = "") -> list[str]:
        """Keys under ``prefix`` (recursive), sorted."""
        ...

    def delete(self, key: str) -> None:
        """Remove ``key``; no error when absent."""
        ...

    def zarr_store(self, prefix: str, *, read_only: bool = True) -> Any:
        """A zarr store rooted at ``prefix`` (for zarr's own reads and writes)."""
        ...


def _joined(data: bytes | Sequence[bytes | memoryview]) -> bytes:
    if isinstance(data, bytes | bytearray | memoryview):
        return bytes(data)
    return b"".join(memoryview(b).cast("B") for b in data)


class LocalBackend:
    """A directory as a :class:`Backend` (``put`` writes a temp file, fsyncs it, renames it)."""

    remote = False

    def __init__(self, root: str | os.PathLike[str], *, fsync: bool = True):
        self.root = Path(root)
        self.url = str(self.root)
        self.fsync = fsync

    def _path(self, key: str) -> Path:
        return self.root / key

    def get(self, key: str) -> bytes:
        return self._path(key).read_bytes()

    def read_into(self, key: str, view: memoryview, offset: int) -> None:
        from hsgen.store.fsutil import read_exact_into

        fd = os.open(self._path(key), os.O_RDONLY)
        try:
            read_exact_into(fd, view, offset)
        finally:
            os.close(fd)

    def size(self, key: str) -> int:
        return self._path(key).stat().st_size

    def mtime(self, key: str) -> float:
        return self._path(key).stat().st_mtime

    def put(self, key: str, data: bytes | Sequence[bytes | memoryview]) -> None:
        from hsgen.store.fsutil import fsync_dir, write_file

        path = self._path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp-{secrets.token_hex(4)}")
        buffers = [data] if isinstance(data, bytes | bytearray | memoryview) else list(data)
        try:
            write_file(tmp, buffers, fsync=self.fsync)
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        if self.fsync:
            fsync_dir(path.parent)

    def list(self, prefix: str = "") -> list[str]:
        out = []
        base = self.root / prefix if prefix else self.root
        if not base.is_dir():
            return []
        for dirpath, _dirs, files in os.walk(base):
            rel = os.path.relpath(dirpath, self.root)
            for f in files:
                if not f.startswith("."):
                    out.append(f if rel == "." else f"{rel}/{f}".replace(os.sep, "/"))
        return sorted(out)

    def delete(self, key: str) -> None:
        self._path(key).unlink(missing_ok=True)

    def zarr_store(self, prefix: str, *, read_only: bool = True) -> Any:
        from zarr.storage import LocalStore

        return LocalStore(self.root / prefix, read_only=read_only)


class ObjectBackend:
    """``s3://bucket/prefix`` as a :class:`Backend`, through ``zarr.storage.ObjectStore`` (obstore).

    Args:
        url: ``s3://bucket`` or ``s3://bucket/prefix``.
        client_options: extra ``obstore.store.S3Store`` options (the ``AWS_*`` variables are read
            by obstore itself; ``AWS_ENDPOINT_URL`` with ``http://`` allows plain HTTP).
    """

    remote = True

    def __init__(self, url: str, **client_options: Any):
        if not is_remote(url):
            raise StoreError(f"{url}: not an object-store URL (s3://bucket/prefix)")
        from obstore.store import S3Store
        from zarr.storage import ObjectStore

        bucket, _, prefix = url[len("s3://") :].partition("/")
        if not bucket:
            raise StoreError(f"{url}: no bucket named (s3://bucket/prefix)")
        self.url = url.rstrip("/")
        self.prefix = prefix.strip("/")
        options = dict(client_options)
        endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        if endpoint and "endpoint" not in options:
            options["endpoint"] = endpoint
            if endpoint.startswith("http://"):
                options.setdefault("allow_http", True)
        region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
        if region and "region" not in options:
            options["region"] = region
        self._s3 = S3Store(bucket, prefix=self.prefix or None, **options)
        self._bucket = bucket
        self._options = options
        self._zarr = ObjectStore(self._s3)

    def _sync(self, coro):
        from zarr.core.sync import sync

        try:
            return sync(coro)
        except FileNotFoundError:
            raise
        except OSError as e:
            raise OSError(e.errno, f"{self.url}: {e}") from e

    def _missing(self, key: str) -> FileNotFoundError:
        return FileNotFoundError(2, "no such object", f"{self.url}/{key}")

    def get(self, key: str) -> bytes:
        from zarr.core.buffer import default_buffer_prototype

        buf = self._sync(self._zarr.get(key, default_buffer_prototype()))
        if buf is None:
            raise self._missing(key)
        return buf.to_bytes()

    def read_into(self, key: str, view: memoryview, offset: int) -> None:
        import numpy as np
        from zarr.abc.store import RangeByteRequest
        from zarr.core.buffer import default_buffer_prototype

        view = view.cast("B") if view.format != "B" or view.ndim != 1 else view
        if not len(view):
            return
        req = RangeByteRequest(offset, offset + len(view))
        buf = self._sync(self._zarr.get(key, default_buffer_prototype(), byte_range=req))
        if buf is None:
            raise self._missing(key)
        got = buf.as_numpy_array()
        if len(got) != len(view):
            raise EOFError(f"{self.url}/{key}: object ends before byte {offset + len(view)}")
        np.frombuffer(view, dtype=np.uint8)[:] = got

    def size(self, key: str) -> int:
        try:
            return int(self._sync(self._zarr.getsize(key)))
        except FileNotFoundError:
            raise self._missing(key) from None

    def mtime(self, key: str) -> float:
        import obstore

        async def head() -> dict:
            return await obstore.head_async(self._s3, key)

        try:
            return self._sync(head())["last_modified"].timestamp()
        except FileNotFoundError:
            raise self._missing(key) from None

    def put(self, key: str, data: bytes | Sequence[bytes | memoryview]) -> None:
        from zarr.core.buffer import default_buffer_prototype

        self._sync(self._zarr.set(key, default_buffer_prototype().buffer.from_bytes(_joined(data))))

    def list(self, prefix: str = "") -> list[str]:
        async def collect() -> list[str]:
            return [k async for k in self._zarr.list_prefix(prefix)]

        return sorted(self._sync(collect()))

    def delete(self, key: str) -> None:
        self._sync(self._zarr.delete(key))

    def zarr_store(self, prefix: str, *, read_only: bool = True) -> Any:
        from obstore.store import S3Store
        from zarr.storage import ObjectStore

        full = "/".join(p for p in (self.prefix, prefix.strip("/")) if p)
        return ObjectStore(S3Store(self._bucket, prefix=full or None, **self._options), read_only=read_only)


def open_backend(location: str | os.PathLike[str], **options: Any) -> Backend:
    """The backend of ``location``: an ``s3://`` URL or a local path."""
    if is_remote(location):
        return ObjectBackend(str(location), **options)
    return LocalBackend(location)


__all__ = ["Backend", "LocalBackend", "ObjectBackend", "is_remote", "open_backend"]
