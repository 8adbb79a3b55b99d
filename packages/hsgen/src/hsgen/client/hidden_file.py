"""The file step: wait for a server's hidden-state file, read it, validate it, remove it.

vLLM writes ``<shared dir>/cmpl-<id>-<i>-<hex>.safetensors`` (``docs/serve.md``): before the
response (0.18-0.21), from a writer pool under ``<file>.lock`` (0.22-0.23) or only after the
response (0.24+). :class:`HiddenFileReader` waits for the lock to be released or the file to
appear, reads the file, checks keys, shapes, dtypes, token ids and finite values, and removes the
file and its lock. Every file operation goes through :class:`~hsgen.client.shared_dir.SharedDir`: no
link is followed, no open can block, only regular files are read.

The states are read (``preadv`` into new arrays), not mapped, unless asked (``map_file``): a
mapping stays tied to the file, and a writer truncating it later, even after it was unlinked,
kills this process with SIGBUS the next time the samples are touched. Mapping saves a copy, so
it is offered for servers and shared directories that are trusted. A consumer that copies each
sample once (spectrain's read-once online mode) can leave the rows in the open file instead
(``rows_in_file``: :class:`FileRows`) and read them straight into its own buffer.
``scripts/bench_server_files.py`` measures both (docs/decisions.md).
"""

from __future__ import annotations

import asyncio
import dataclasses
import errno
import json
import mmap
import os
import threading
import time
from dataclasses import dataclass

import numpy as np

from hsgen.client.errors import FatalError, FetchError
from hsgen.client.phases import PhaseTimes, timer
from hsgen.client.shared_dir import SharedDir, UnsafePath, lock_held, remove_own_file
from hsgen.protocol import extraction as protocol
from hsgen.protocol.dtypes import STORAGE, all_finite
from hsgen.protocol.prompt import RenderedPrompt
from hsgen.store.fsutil import read_exact_into

STORAGE_DTYPES = STORAGE
"""Logical dtype -> numpy dtype the states are kept in (bf16 as raw uint16 bits, like the store)."""

MAX_HIDDEN_SIZE = 65536
"""The largest hidden size believed when nothing else says what it is (the largest models have
~25k): beyond it a file's header is refused before any of its payload is read."""


MAX_HEADER_BYTES = 1 << 20
"""The largest safetensors header a server's file may have (vLLM's two tensors take ~200 bytes):
a longer one is refused before it is read."""


@dataclass(frozen=True)
class ExpectedStates:
    """What the server's files must hold, checked on the header before the payload is read.

    Each figure is None when unknown. For an existing store they are its header's (``store``
    names it); for a new store the layer count is the number of layer ids asked for, the hidden
    size the model config's (``hidden_from`` names the file), the dtype the one asked for
    (:mod:`hsgen.generate.store_shape`). A refusal says whose figure the file's differs from.
    """

    num_layers: int | None = None
    hidden_size: int | None = None
    dtype: str | None = None
    store: str | None = None
    """The store whose header the figures are (None: the model's and the request's)."""
    hidden_from: str = ""
    """Where the model's hidden size was read (its ``config.json``), named in a refusal."""

    @staticmethod
    def model_hidden_size(model_dir: str | os.PathLike[str] | None) -> int | None:
        """The hidden size in ``model_dir/config.json`` (a multimodal model's ``text_config``), or None."""
        if not model_dir:
            return None
        try:
            with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as f:
                config = json.load(f)
            size = config.get("text_config", config)["hidden_size"]
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return None
        return size if isinstance(size, int) and size > 0 else None

    def problem(self, shape: tuple[int, ...], dtype: str) -> str | None:
        """Why a ``[T, layers, hidden]`` tensor of ``dtype`` does not fit (None when it does)."""
        store = f" ({self.store})" if self.store else ""
        if self.dtype is not None and dtype != self.dtype:
            whose = (
                f"the store holds {self.dtype}{store}"
                if self.store
                else f"{self.dtype} was asked for (--dtype)"
            )
            return f"the server sends {dtype} hidden states, {whose}"
        if self.num_layers is not None and shape[1] != self.num_layers:
            whose = (
                f"the store holds {self.num_layers}{store}"
                if self.store
                else f"{self.num_layers} were asked for"
            )
            return f"the server sends {shape[1]} layers, {whose}: check the server's eagle_aux_hidden_state_layer_ids"
        if self.hidden_size is not None and shape[2] != self.hidden_size:
            if self.store:
                return f"the server sends hidden size {shape[2]}, the store's is {self.hidden_size}{store}"
            where = f" ({self.hidden_from})" if self.hidden_from else ""
            return f"the server sends hidden size {shape[2]}, the model's is {self.hidden_size}{where}"
        if self.hidden_size is None and shape[2] > MAX_HIDDEN_SIZE:
            return f"the server sends hidden size {shape[2]}, more than any model's ({MAX_HIDDEN_SIZE})"
        return None

    def merged(self, layers: int | None, hidden_size: int | None, dtype: str | None) -> ExpectedStates:
        """These figures with ``layers``, ``hidden_size`` and ``dtype`` (when given) in their place:
        what a user stated outright (``ClientConfig.expect_*``) wins over what was inferred."""
        return dataclasses.replace(
            self,
            num_layers=layers or self.num_layers,
            hidden_size=hidden_size or self.hidden_size,
            dtype=dtype or self.dtype,
            hidden_from=self.hidden_from if not hidden_size else "",
        )


class WrongStates(Exception):
    """The file's header does not fit the request: its token count, layers, hidden size or dtype."""

    def __init__(self, message: str, fatal: bool):
        super().__init__(message)
        self.fatal = fatal  # the server's shape or dtype (every file would be wrong), not this file's tokens


class NotReady(Exception):
    """The file is missing or shorter than its header says (a writer may still be busy)."""


MAX_HELD_FILES = 256
"""Server files held open at once for their rows (:class:`FileRows`): past it a file's rows are
read at once instead, so many small samples in flight never take the descriptors that the store's
own files and the connections need."""


class _OpenFile:
    """A descriptor closed when the last :class:`FileRows` on it is closed or collected."""

    held = 0
    """Descriptors of this kind open in the process."""
    _lock = threading.Lock()

    def __init__(self, fd: int):
        self.fd = fd
        with _OpenFile._lock:
            _OpenFile.held += 1

    def close(self) -> None:
        fd, self.fd = self.fd, -1
        if fd >= 0:
            with _OpenFile._lock:
                _OpenFile.held -= 1
            os.close(fd)

    def __del__(self) -> None:
        self.close()


class FileRows:
    """Hidden-state rows left in the server's file (its name already removed), read on demand.

    For a consumer that copies each sample once: :meth:`read_into` lands the rows in the
    caller's buffer with ``preadv`` (one copy, no mapping to set up and tear down per file).
    It has the ``shape``, ``ndim``, ``dtype`` and ``nbytes`` of the array it stands for;
    ``rows[:n]`` keeps the first ``n`` rows; ``numpy.asarray(rows)`` reads them all into a new
    array. The file's pages stay allocated until :meth:`close` (or collection).
    """

    def __init__(self, file: _OpenFile, offset: int, shape: tuple[int, ...], dtype: np.dtype):
        self._file = file
        self.offset = offset
        self.shape = tuple(shape)
        self.dtype = np.dtype(dtype)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, key) -> FileRows:
        if not isinstance(key, slice) or key.start not in (None, 0) or key.step not in (None, 1):
            raise TypeError("FileRows takes only [:n]")
        n = min(self.shape[0], self.shape[0] if key.stop is None else max(0, key.stop))
        return FileRows(self._file, self.offset, (n, *self.shape[1:]), self.dtype)

    def read_into(self, out: np.ndarray, *, piece_bytes: int = 1 << 20, check=None) -> None:
        """Read the rows into ``out`` (C-contiguous, this shape, an item size of this dtype's),
        ``piece_bytes`` at a time; ``check(piece)`` runs on each piece as it lands (in cache).

        Raises:
            ValueError: ``out`` does not fit, or the file was closed.
            EOFError: the file is shorter than its header said.
        """
        if (
            tuple(out.shape) != self.shape
            or not out.flags.c_contiguous
            or out.dtype.itemsize != self.dtype.itemsize
        ):
            raise ValueError(f"buffer {out.shape} {out.dtype} does not hold rows {self.shape} {self.dtype}")
        if self._file.fd < 0:
            raise ValueError("the file's rows were released")
        flat = out.reshape(-1)
        view = memoryview(flat.view(np.uint8))
        step = max(self.dtype.itemsize, piece_bytes // self.dtype.itemsize * self.dtype.itemsize)
        for lo in range(0, len(view), step):
            piece = view[lo : lo + step]
            read_exact_into(self._file.fd, piece, self.offset + lo)
            if check is not None:
                check(flat[lo // self.dtype.itemsize : (lo + len(piece)) // self.dtype.itemsize])

    def read_range(self, out: memoryview, start: int) -> None:
        """Read bytes ``[start, start + len(out))`` of the rows into ``out``.

        Raises:
            EOFError: the file is shorter than its header said.
            ValueError: the file was closed.
        """
        if self._file.fd < 0:
            raise ValueError("the file's rows were released")
        if start + len(out) > self.nbytes:
            raise ValueError(f"bytes {start}..{start + len(out)} are past the rows' {self.nbytes}")
        read_exact_into(self._file.fd, out, self.offset + start)

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        out = np.empty(self.shape, dtype=self.dtype)
        self.read_into(out)
        return out if dtype is None else out.astype(dtype)

    def close(self) -> None:
        """Release the file (its pages are freed once nothing else holds it)."""
        self._file.close()


def read_hidden_states_fd(
    fd: int,
    *,
    map_file: bool = False,
    rows_in_file: bool = False,
    tokens: int | None = None,
    extra_tokens: bool = False,
    expect: ExpectedStates | None = None,
) -> tuple[np.ndarray | FileRows, np.ndarray, str]:
    """Read an open vLLM hidden-states safetensors file: ``(hidden_states, token_ids, dtype)``.

    The header is checked (:func:`hsgen.protocol.extraction.read_safetensors_header`), then each tensor is
    read with ``preadv`` straight into a new array: the arrays are this process's own memory,
    which nothing done to the file afterwards can change. With ``map_file`` they are read-only
    views of a private mapping instead (no copy; a writer truncating the file later kills this
    process with SIGBUS when they are touched). With ``rows_in_file`` the token ids are read and
    the hidden states are :class:`FileRows` on a duplicate of ``fd``: read later, once, straight
    into the consumer's buffer (a file truncated meanwhile gives a short read, an error, never a
    SIGBUS); past :data:`MAX_HELD_FILES` held at once they are read now instead. ``fd`` may be
    closed afterwards.

    With ``tokens`` (the prompt's length), the header's token count must be that (or more with
    ``extra_tokens``: generated tokens, dropped) and only that many rows are read; with
    ``expect``, its layers, hidden size and dtype must fit. Both are checked before any of the
    payload is read, so a huge file costs no more than its header.

    Raises:
        NotReady: the file is shorter than its header says (or shrank while it was read).
        protocol.ProtocolError: keys, dtypes or shapes are wrong.
        WrongStates: the header does not fit ``tokens`` or ``expect``.
    """
    size = os.fstat(fd).st_size
    if size < 8:
        raise NotReady(f"file has {size} bytes")
    with os.fdopen(os.dup(fd), "rb", buffering=0) as f:
        try:
            tensors = protocol.read_safetensors_header(f, size, max_header_bytes=MAX_HEADER_BYTES)
        except protocol.ProtocolError as e:
            if "truncated" in str(e) or "shorter" in str(e):
                raise NotReady(str(e)) from None
            raise
    for key in (protocol.HIDDEN_STATES_KEY, protocol.TOKEN_IDS_KEY):
        if key not in tensors:
            raise protocol.ProtocolError(f"file has no {key!r} tensor (has {sorted(tensors)})")
    hs, ti = tensors[protocol.HIDDEN_STATES_KEY], tensors[protocol.TOKEN_IDS_KEY]
    if hs.dtype not in STORAGE_DTYPES:
        raise protocol.ProtocolError(f"hidden_states dtype {hs.dtype} is not bfloat16, float16 or float32")
    if ti.dtype != "int64":
        raise protocol.ProtocolError(f"token_ids dtype {ti.dtype} is not int64")
    if len(hs.shape) != 3 or len(ti.shape) != 1 or hs.shape[0] != ti.shape[0]:
        raise protocol.ProtocolError(
            f"shapes hidden_states {list(hs.shape)} / token_ids {list(ti.shape)} are not [T, layers, hidden] / [T]"
        )
    if tokens is not None:
        t = ti.shape[0]
        if t < tokens or (t != tokens and not extra_tokens):
            raise WrongStates(f"file has {t} tokens but {tokens} were sent", fatal=False)
        hs, ti = _first_rows(hs, tokens), _first_rows(ti, tokens)
    problem = (expect or ExpectedStates()).problem(hs.shape, hs.dtype)
    if problem is not None:
        raise WrongStates(problem, fatal=True)
    storage = np.dtype(STORAGE_DTYPES[hs.dtype])
    if rows_in_file and _OpenFile.held < MAX_HELD_FILES:
        try:
            held = _OpenFile(os.dup(fd))
        except OSError as e:  # out of descriptors (many samples held): read this one now
            if e.errno not in (errno.EMFILE, errno.ENFILE):
                raise
        else:
            try:
                tokens = _pread_array(fd, ti, np.dtype(np.int64))
            except BaseException:
                held.close()
                raise
            return FileRows(held, hs.start, hs.shape, storage), tokens, hs.dtype
    if map_file:
        flags = mmap.MAP_PRIVATE | getattr(mmap, "MAP_POPULATE", 0)
        mm = mmap.mmap(fd, size, flags=flags, prot=mmap.PROT_READ)
        hidden = np.frombuffer(mm, dtype=storage, count=hs.nbytes // storage.itemsize, offset=hs.start)
        tokens = np.frombuffer(mm, dtype=np.int64, count=ti.shape[0], offset=ti.start)
        return hidden.reshape(hs.shape), tokens, hs.dtype
    return _pread_array(fd, hs, storage), _pread_array(fd, ti, np.dtype(np.int64)), hs.dtype


def _first_rows(t: protocol.TensorInfo, n: int) -> protocol.TensorInfo:
    row = t.nbytes // t.shape[0] if t.shape[0] else 0
    return dataclasses.replace(t, shape=(n, *t.shape[1:]), end=t.start + n * row)


def _pread_array(fd: int, tensor: protocol.TensorInfo, dtype: np.dtype) -> np.ndarray:
    out = np.empty(tensor.shape, dtype=dtype)
    try:
        read_exact_into(fd, memoryview(out.reshape(-1)).cast("B"), tensor.start)
    except EOFError as e:
        raise NotReady(f"file shrank while it was read: {e}") from None
    return out


def read_hidden_states_file(path: str) -> tuple[np.ndarray, np.ndarray, str]:
    """:func:`read_hidden_states_fd` of ``path`` (not followed if a symlink; regular files only).

    Raises:
        NotReady: the file is missing or truncated.
        protocol.ProtocolError: keys, dtypes or shapes are wrong, or it is not a regular file.
    """
    shared = SharedDir(os.path.dirname(os.path.abspath(path)) or "/")
    try:
        fd = shared.open_regular([os.path.basename(path)])
    except UnsafePath as e:
        raise protocol.ProtocolError(str(e)) from None
    finally:
        shared.close()
    if fd is None:
        raise NotReady("file does not exist")
    try:
        return read_hidden_states_fd(fd)
    finally:
        os.close(fd)


@dataclass(frozen=True)
class FileWait:
    """How patient the file step is (``ClientConfig`` fields of the same names)."""

    file_wait_s: float
    lock_timeout_s: float
    settle_s: float
    check_finite: bool
    include_output_tokens: bool
    map_files: bool = False
    rows_in_file: bool = False
    expect: ExpectedStates | None = None


class HiddenFileReader:
    """Waits for, reads, validates and removes the server's files in one shared directory.

    Args:
        shared: the shared directory handle.
        wait: timeouts and checks.
        pool: executor that reads and validates files (off the event loop).
    """

    def __init__(self, shared: SharedDir, wait: FileWait, pool, phases: PhaseTimes | None = None):
        self.shared = shared
        self.wait = wait
        self.pool = pool
        self.phases = phases

    async def wait_and_read(
        self, parts: list[str], prompt: RenderedPrompt, url: str
    ) -> tuple[np.ndarray, np.ndarray, str]:
        """The validated ``(hidden[:n], token_ids[:n], dtype)`` of the file ``parts`` for ``prompt``.

        Raises:
            FetchError: the file did not appear, stayed locked, is truncated or invalid.
            UnsafePath: the file, its lock or a directory on the way is not what it must be.
        """
        cfg = self.wait
        loop = asyncio.get_running_loop()
        lock = self.shared.lock_parts(parts)
        start = time.monotonic()
        appear_deadline = start + cfg.file_wait_s
        lock_deadline: float | None = None
        settle_deadline: float | None = None
        delay = 0.0005
        path = self.shared.show(parts)
        while True:
            now = time.monotonic()
            state = self.shared.lock_state(lock)
            if state is False:  # a writer holds it
                lock_deadline = lock_deadline or now + cfg.lock_timeout_s
                settle_deadline = None
                if now > lock_deadline:
                    raise FetchError(
                        "lock_timeout",
                        f"{path}.lock still locked after {cfg.lock_timeout_s}s (writer stuck or stale lock)",
                        transient=True,
                        endpoint=url,
                    )
            else:
                try:
                    return await loop.run_in_executor(self.pool, self._read_validate, parts, prompt)
                except NotReady as e:
                    exists = self.shared.exists(parts)
                    if state is True or exists:
                        settle_deadline = settle_deadline or now + cfg.settle_s
                        if now > settle_deadline:
                            kind = "truncated_file" if exists else "missing_file"
                            raise FetchError(
                                kind, f"{path}: {e} after the writer finished", transient=True, endpoint=url
                            ) from None
                    elif now > appear_deadline:
                        raise FetchError(
                            "missing_file",
                            f"{path}: neither the file nor its lock appeared within {cfg.file_wait_s}s",
                            transient=True,
                            endpoint=url,
                        ) from None
            await asyncio.sleep(delay)
            delay = min(delay * 1.5, 0.02)

    def _read_validate(
        self, parts: list[str], prompt: RenderedPrompt
    ) -> tuple[np.ndarray | FileRows, np.ndarray, str]:
        with timer(self.phases, "validate"):
            return self._read_validate_timed(parts, prompt)

    def _read_validate_timed(
        self, parts: list[str], prompt: RenderedPrompt
    ) -> tuple[np.ndarray | FileRows, np.ndarray, str]:
        path = self.shared.show(parts)
        fd = self.shared.open_regular(parts)
        if fd is None:
            raise NotReady("file does not exist")
        n = len(prompt.token_ids)
        try:
            hidden, tokens, dtype = read_hidden_states_fd(
                fd, map_file=self.wait.map_files, rows_in_file=self.wait.rows_in_file, tokens=n,
                extra_tokens=self.wait.include_output_tokens, expect=self.wait.expect,
            )  # fmt: skip
        except protocol.ProtocolError as e:
            raise FetchError("bad_file", f"{path}: {e}", transient=True) from None
        except WrongStates as e:
            if e.fatal:
                raise FatalError("wrong_states", f"{path}: {e}") from None
            raise FetchError("token_mismatch", f"{path}: {e}", transient=False) from None
        finally:
            os.close(fd)
        sent = np.asarray(prompt.token_ids, dtype=np.int64)
        if not np.array_equal(tokens[:n], sent):
            bad = int(np.argmax(tokens[:n] != sent))
            raise FetchError(
                "token_mismatch",
                f"{path}: token_ids differ from those sent at position {bad} "
                f"({int(tokens[bad])} != {int(sent[bad])})",
                transient=False,
            )
        hidden = hidden[:n]
        if self.wait.check_finite and not all_finite(np.asarray(hidden), dtype):
            raise FetchError("non_finite", f"{path}: hidden states contain NaN or Inf", transient=False)
        return hidden, tokens[:n], dtype

    def remove(self, parts: list[str]) -> None:
        """Remove the file and its lock (relative to their directory; missing is fine)."""
        self.shared.remove(parts)
        self.shared.remove(self.shared.lock_parts(parts))


async def remove_misplaced(path: str, request_id: str, wait_s: float) -> None:
    """Remove a file a server wrote outside the shared directory, once its writer is done.

    Only a file whose name starts with this request's unique id is removed (see
    :func:`~hsgen.client.shared_dir.remove_own_file`); waits at most ``wait_s`` for the writer.
    """
    lock = protocol.lock_path(path)
    deadline = time.monotonic() + wait_s
    seen_lock = False
    while time.monotonic() < deadline:
        held = lock_held(lock)
        seen_lock = seen_lock or held is not None
        if held is False and os.path.lexists(path):
            break
        if held is None and seen_lock:
            break
        if held is None and not seen_lock and os.path.lexists(path):
            break
        await asyncio.sleep(0.02)
    remove_own_file(path, request_id)


__all__ = [
    "MAX_HEADER_BYTES",
    "MAX_HELD_FILES",
    "MAX_HIDDEN_SIZE",
    "STORAGE_DTYPES",
    "ExpectedStates",
    "FileRows",
    "FileWait",
    "HiddenFileReader",
    "NotReady",
    "WrongStates",
    "all_finite",
    "read_hidden_states_fd",
    "read_hidden_states_file",
    "remove_misplaced",
]
