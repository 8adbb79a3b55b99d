"""The servers' shared directory, touched only through a handle on it: no link is ever followed.

A server (or anyone who can write the shared directory) names a file in a response, and the
file may appear only later. Between the two, a path component could become a symlink to
another place, or the ``.lock`` a FIFO. So nothing here opens a path string: the directory is
opened once (``--shared-dir`` as the user gave it), every component below it is opened with
``O_NOFOLLOW`` relative to its parent's descriptor, files are opened ``O_NONBLOCK`` (a FIFO
cannot hang the caller) and only regular files are read; unlinks are relative to the parent's
descriptor. A path that leaves the directory, goes through a symlink or names anything but a
regular file raises :class:`UnsafePath`.

Requests carry a per-client id prefix (:func:`new_client_prefix`), which vLLM puts in the file
name (``cmpl-<X-Request-Id>-<i>-<hex>.safetensors``); :meth:`SharedDir.remove_owned` removes a
client's leftovers and nothing else.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import secrets
import stat
from collections.abc import Iterator
from contextlib import contextmanager

from hsgen.protocol import extraction as protocol

log = logging.getLogger(__name__)

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_REQUEST_ID_PREFIXES = ("cmpl-", "chatcmpl-", "")


class UnsafePath(Exception):
    """A path outside the shared directory, through a symlink, or naming a non-regular file."""


def new_client_prefix() -> str:
    """``hsgen-<12 hex>-``: the start of every request id (and so file name) of one client."""
    return f"hsgen-{secrets.token_hex(6)}-"


def owned_by(name: str, prefix: str) -> bool:
    """Whether the file ``name`` belongs to a request whose ``X-Request-Id`` starts with ``prefix``."""
    return any(name.startswith(p + prefix) for p in _REQUEST_ID_PREFIXES)


class SharedDir:
    """A handle on the shared directory (opened on first use; thread-safe).

    Args:
        path: the directory as seen from this machine (its own symlinks are resolved once).
    """

    def __init__(self, path: str):
        self.path = os.path.abspath(path)
        self.real = os.path.realpath(path)
        self._fd: int | None = None

    def fd(self) -> int:
        """The directory's descriptor (opened now if needed; ``OSError`` if it cannot be)."""
        if self._fd is None:
            self._fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        return self._fd

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def relative(self, path: str) -> list[str]:
        """The components of ``path`` below the directory, read lexically (nothing is resolved).

        Raises:
            UnsafePath: ``path`` is relative or lies outside the directory.
        """
        if not os.path.isabs(path):
            raise UnsafePath(f"{path!r} is not an absolute path")
        norm = os.path.normpath(path)
        for base in (self.path, self.real):
            root = base.rstrip("/") + "/"
            if norm.startswith(root) and len(norm) > len(root):
                return norm[len(root) :].split("/")
        raise UnsafePath(f"{path!r} is outside the shared directory {self.path!r}")

    @contextmanager
    def parent(self, parts: list[str]) -> Iterator[int]:
        """The descriptor of the directory holding ``parts[-1]``, walked without following links.

        Raises:
            UnsafePath: a component is a symlink or not a directory.
            FileNotFoundError: a component does not exist.
        """
        fd = self.fd()
        opened: list[int] = []
        try:
            for name in parts[:-1]:
                try:
                    fd = os.open(name, _DIR_FLAGS, dir_fd=fd)
                except OSError as e:
                    if e.errno in (errno.ELOOP, errno.ENOTDIR):
                        raise UnsafePath(
                            f"{name!r} in {'/'.join(parts)!r} is a symlink or not a directory"
                        ) from None
                    raise
                opened.append(fd)
            yield fd
        finally:
            for o in opened:
                os.close(o)

    def open_regular(self, parts: list[str]) -> int | None:
        """A read-only descriptor of the regular file ``parts``, or None when it does not exist.

        Raises:
            UnsafePath: it is a symlink, a FIFO, a directory or another non-regular file.
        """
        try:
            with self.parent(parts) as parent:
                fd = os.open(parts[-1], _FILE_FLAGS, dir_fd=parent)
        except FileNotFoundError:
            return None
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise UnsafePath(f"{self.show(parts)} is a symlink") from None
            if e.errno in (errno.ENXIO, errno.EISDIR):
                raise UnsafePath(f"{self.show(parts)} is not a regular file") from None
            raise
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            os.close(fd)
            raise UnsafePath(f"{self.show(parts)} is not a regular file (mode {stat.filemode(mode)})")
        return fd

    def lock_state(self, parts: list[str]) -> bool | None:
        """For ``<file>.lock``: True if it exists and is not locked, False if locked, None if absent.

        Never blocks: the open is non-blocking and the ``flock`` is ``LOCK_NB``.
        """
        fd = self.open_regular(parts)
        if fd is None:
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            return True
        except OSError as e:
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                return False
            raise
        finally:
            os.close(fd)  # closing releases our shared lock

    def exists(self, parts: list[str]) -> bool:
        """Whether ``parts`` names an entry (of any kind; links are not followed)."""
        try:
            with self.parent(parts) as parent:
                os.stat(parts[-1], dir_fd=parent, follow_symlinks=False)
            return True
        except (FileNotFoundError, UnsafePath):
            return False

    def remove(self, parts: list[str]) -> bool:
        """Unlink ``parts`` relative to its parent's descriptor; False if it was not there.

        A symlink is removed as a link (its target is untouched); a path through a symlinked
        directory is refused, never followed. Other errors are logged.
        """
        try:
            with self.parent(parts) as parent:
                os.unlink(parts[-1], dir_fd=parent)
            return True
        except FileNotFoundError:
            return False
        except (OSError, UnsafePath) as e:
            log.warning("could not remove %s: %s", self.show(parts), e)
            return False

    def owned(self, prefix: str) -> list[str]:
        """Names at the top of the directory of files, locks (or links) of ``prefix``'s requests."""
        if not prefix:
            raise ValueError("an empty prefix would match every client's files")
        try:
            names = [e.name for e in os.scandir(self.fd()) if owned_by(e.name, prefix)]
        except OSError as e:
            log.warning("cannot list %s: %s", self.path, e)
            return []
        out = []
        for name in names:
            try:
                st = os.stat(name, dir_fd=self.fd(), follow_symlinks=False)
            except FileNotFoundError:
                continue
            if stat.S_ISREG(st.st_mode) or stat.S_ISFIFO(st.st_mode) or stat.S_ISLNK(st.st_mode):
                out.append(name)
        return out

    def remove_owned(self, prefix: str) -> int:
        """Remove the files and locks at the top of the directory that belong to ``prefix``'s requests."""
        return sum(self.remove([name]) for name in self.owned(prefix))

    @staticmethod
    def lock_parts(parts: list[str]) -> list[str]:
        """The components of ``<file>.lock``."""
        return [*parts[:-1], parts[-1] + protocol.LOCK_SUFFIX]

    def show(self, parts: list[str]) -> str:
        return os.path.join(self.path, *parts)


def count_owned(shared: SharedDir, prefix: str) -> int:
    """How many entries :meth:`SharedDir.remove_owned` would remove."""
    return len(shared.owned(prefix))


def remove_own_file(path: str, request_id: str) -> bool:
    """Remove ``path`` (and its lock) outside any shared directory, only if its name is ``request_id``'s.

    For a file the server wrote where it should not have: its name starting with this
    request's unique id is what makes removing it safe, wherever it is (links are not followed).
    """
    name = os.path.basename(path)
    if not request_id or not any(name.startswith(p + request_id) for p in _REQUEST_ID_PREFIXES):
        return False
    removed = False
    try:
        dfd = os.open(os.path.dirname(path) or ".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        for entry in (name, name + protocol.LOCK_SUFFIX):
            try:
                st = os.stat(entry, dir_fd=dfd, follow_symlinks=False)
                if stat.S_ISDIR(st.st_mode):
                    continue
                os.unlink(entry, dir_fd=dfd)
                removed = True
            except FileNotFoundError:
                pass
            except OSError as e:
                log.warning("could not remove %s: %s", os.path.join(os.path.dirname(path), entry), e)
    finally:
        os.close(dfd)
    return removed


def lock_held(lock: str) -> bool | None:
    """Whether ``lock`` (opened without following links, non-blocking) is held; None if absent."""
    try:
        fd = os.open(lock, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return False
    except OSError as e:
        return e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES)
    finally:
        os.close(fd)


__all__ = [
    "SharedDir",
    "UnsafePath",
    "count_owned",
    "lock_held",
    "new_client_prefix",
    "owned_by",
    "remove_own_file",
]
