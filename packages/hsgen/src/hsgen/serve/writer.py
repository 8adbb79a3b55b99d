"""Writing hidden-state files the way vLLM's ``ExampleHiddenStatesConnector`` does.

The file is ``safetensors`` (``save_file``, no metadata) written in place, with
``hidden_states [T, n_layers, H]`` in the model dtype and ``token_ids [T]`` int64. From vLLM
0.22 on, ``<path>.lock`` is created and held with ``flock(LOCK_EX)`` from before the HTTP
response until ``save_file`` returns (successfully or not). A failed write is only logged.
"""

from __future__ import annotations

import fcntl
import logging
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from hsgen.protocol import extraction as protocol

log = logging.getLogger(__name__)


@dataclass
class PendingWrite:
    """A file the server promised in a response: its path and, when locking, the held lock fd."""

    path: str
    lock_fd: int | None = None


class HiddenStatesWriter:
    """Owns the writer thread pool, the ``.lock`` protocol and file-level fault injection."""

    def __init__(self, *, use_lock: bool, num_threads: int = 4, capacity=None):
        """
        Args:
            use_lock: hold ``flock(LOCK_EX)`` on ``<path>.lock`` during each write (vLLM >= 0.22).
            num_threads: writer threads.
            capacity: optional :class:`~hsgen.serve.capacity.CapacityModel`; its
                ``write_seconds`` slows writes down to a simulated storage speed.
        """
        self.use_lock = use_lock
        self.capacity = capacity
        self._pool = ThreadPoolExecutor(max_workers=num_threads, thread_name_prefix="hs-writer")
        self._leaked: list[int] = []
        self._mutex = threading.Lock()
        self._inflight = 0
        self.files_written = 0
        self.write_errors = 0

    @property
    def inflight(self) -> int:
        """Writes promised (locked or queued) and not finished yet."""
        return self._inflight

    def prepare(self, path: str) -> PendingWrite:
        """Create the parent directory and, when locking, take ``flock(LOCK_EX)`` on ``<path>.lock``.

        Called before the response is sent, so a reader that sees the response and takes
        ``LOCK_SH`` blocks until the write ends.
        """
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        fd = None
        if self.use_lock:
            fd = os.open(protocol.lock_path(path), os.O_CREAT | os.O_RDWR, 0o644)
            fcntl.flock(fd, fcntl.LOCK_EX)
        with self._mutex:
            self._inflight += 1
        return PendingWrite(path, fd)

    def submit(
        self,
        pending: PendingWrite,
        hidden_states: torch.Tensor,
        token_ids: list[int],
        fault: str | None = None,
    ) -> Future:
        """Write in the pool; the lock (if any) is released when the write ends."""
        return self._pool.submit(self.write, pending, hidden_states, token_ids, fault)

    def write(
        self,
        pending: PendingWrite,
        hidden_states: torch.Tensor,
        token_ids: list[int],
        fault: str | None = None,
    ) -> None:
        """Write one file now (in the calling thread), applying a file fault if given. Never raises."""
        from safetensors.torch import save_file

        try:
            t0 = time.perf_counter()
            if fault == "missing_file":
                log.warning("fault injection: not writing %s", pending.path)
                return
            hs = hidden_states.contiguous()
            ids = torch.tensor(list(token_ids), dtype=torch.int64)
            if fault == "nan":
                hs = hs.clone()
                hs[len(ids) // 2, 0, : max(1, hs.shape[-1] // 4)] = float("nan")
            if fault == "token_mismatch":
                ids = ids.clone()
                ids[-1] = ids[-1] + 1
            if self.capacity is not None:
                delay = self.capacity.write_seconds(hs.numel() * hs.element_size() + 8 * len(ids))
                time.sleep(max(0.0, delay - (time.perf_counter() - t0)))
            save_file({protocol.HIDDEN_STATES_KEY: hs, protocol.TOKEN_IDS_KEY: ids}, pending.path)
            if fault == "truncated_file":
                size = os.path.getsize(pending.path)
                os.truncate(pending.path, size // 2)
            self.files_written += 1
        except Exception:  # vLLM only logs a failed write; the client must validate
            self.write_errors += 1
            log.exception("failed to write hidden states to %s", pending.path)
        finally:
            self._release(pending, keep_locked=fault == "stale_lock")

    def _release(self, pending: PendingWrite, *, keep_locked: bool = False) -> None:
        with self._mutex:
            self._inflight -= 1
            if pending.lock_fd is not None:
                if keep_locked:
                    log.warning("fault injection: never releasing %s", protocol.lock_path(pending.path))
                    self._leaked.append(pending.lock_fd)
                else:
                    os.close(pending.lock_fd)
            pending.lock_fd = None

    def abandon(self, pending: PendingWrite) -> None:
        """Give up a prepared write (the request failed): release the lock, leave the ``.lock`` file."""
        self._release(pending)

    def close(self) -> None:
        """Finish queued writes, then release leaked locks."""
        self._pool.shutdown(wait=True)
        with self._mutex:
            for fd in self._leaked:
                os.close(fd)
            self._leaked.clear()
