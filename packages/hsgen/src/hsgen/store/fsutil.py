"""Durable file-system primitives: full writes, fsync of files and directories, atomic files."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import secrets
import signal
import time
from collections.abc import Sequence
from concurrent.futures import Executor
from pathlib import Path

_IOV_MAX = 1024

FAILPOINT_ENV = "HSGEN_STORE_FAILPOINT"
"""Crash-test hook: when set to a failpoint's name, the process SIGKILLs itself there."""


def failpoint(name: str) -> None:
    """``kill -9`` this process if ``$HSGEN_STORE_FAILPOINT`` names this point (crash tests only)."""
    if os.environ.get(FAILPOINT_ENV) == name:
        os.kill(os.getpid(), signal.SIGKILL)


def write_all(fd: int, buffers: Sequence[memoryview | bytes]) -> int:
    """Write every byte of ``buffers`` to ``fd`` in order (``writev``, retrying short writes).

    Returns:
        Bytes written.
    """
    views = [memoryview(b).cast("B") for b in buffers if len(memoryview(b).cast("B"))]
    total = 0
    while views:
        batch = views[:_IOV_MAX]
        n = os.writev(fd, batch)
        total += n
        consumed = 0
        while consumed < len(batch) and n >= len(batch[consumed]):
            n -= len(batch[consumed])
            consumed += 1
        views = views[consumed:]
        if n:
            views[0] = views[0][n:]
    return total


def pwrite_all(fd: int, buf: memoryview | bytes, offset: int) -> None:
    """Write every byte of ``buf`` to ``fd`` at ``offset`` (``pwrite``, retrying short writes)."""
    view = memoryview(buf).cast("B")
    done = 0
    while done < len(view):
        done += os.pwrite(fd, view[done:], offset + done)


def read_exact_into(fd: int, buf: memoryview, offset: int) -> None:
    """Fill ``buf`` from ``fd`` at ``offset`` (``preadv``, retrying short reads).

    Raises:
        EOFError: the file ends before ``buf`` is full.
    """
    view = buf.cast("B") if buf.format != "B" or buf.ndim != 1 else buf
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n == 0:
            raise EOFError(f"file ends at byte {offset + done}, {len(view) - done} bytes short")
        done += n


def write_file(path: Path, buffers: Sequence[memoryview | bytes], *, fsync: bool = True) -> int:
    """Create ``path`` (must not exist), write ``buffers``, optionally fsync; returns bytes written."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        n = write_all(fd, buffers)
        if fsync:
            os.fsync(fd)
    except OSError as e:  # a write error (disk full) names the file
        raise OSError(e.errno, e.strerror, str(path)) from None
    finally:
        os.close(fd)
    return n


def fsync_dir(path: Path) -> None:
    """fsync a directory so entries created or renamed in it survive a crash."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_path(path: str | Path) -> None:
    """fsync a file or directory by path."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: Path, pool: Executor | None = None) -> None:
    """fsync every file and directory under ``root`` (and ``root``), concurrently on ``pool`` if given."""
    paths = []
    for dirpath, _dirs, files in os.walk(root):
        paths.append(dirpath)
        paths += [os.path.join(dirpath, f) for f in files]
    if pool is None:
        for p in paths:
            fsync_path(p)
    else:
        list(pool.map(fsync_path, paths))


def atomic_write_exclusive(path: Path, data: bytes) -> bool:
    """Create ``path`` with ``data`` atomically and durably unless it exists.

    Writes a temp file, fsyncs it, hard-links it to ``path`` (fails if ``path`` exists), fsyncs
    the directory. Returns ``True`` if this call created ``path``.
    """
    tmp = path.with_name(f".{path.name}.tmp-{secrets.token_hex(4)}")
    write_file(tmp, [data])
    try:
        os.link(tmp, path)
        created = True
    except FileExistsError:
        created = False
    finally:
        tmp.unlink()
    fsync_dir(path.parent)
    return created


def try_lock(fd: int, *, attempts: int = 5, delay: float = 0.05) -> bool:
    """Take an exclusive ``flock`` on ``fd`` without blocking; retries briefly, False if held."""
    for i in range(attempts):
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except OSError as e:
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise
        if i + 1 < attempts:
            time.sleep(delay)
    return False


def is_locked(path: Path) -> bool:
    """True if another open file description holds an ``flock`` on ``path`` (False if absent)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                return True
            raise
        with contextlib.suppress(OSError):
            fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    finally:
        os.close(fd)


def tree_bytes(path: Path) -> int:
    """Total size of the regular files under ``path`` (0 if it is gone)."""
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            with contextlib.suppress(FileNotFoundError):
                total += os.stat(os.path.join(root, name)).st_size
    return total
