"""Who is filling a store right now: one lease file per running generator, live while locked.

``<store>/.leases/<id>.json`` holds a generator's rank, world size, host, pid and the prefix of
its request ids (the start of every file the servers write for it). The owner holds an
``flock`` on the file for as long as it runs; a killed process's lock goes with it, so a lease
whose lock is free is dead. Leases are taken under ``<store>/.leases/.mutex``, so two
generators starting together see each other.

A new generator refuses to start while a live lease has its rank (the same work would be done
twice) or another world size (the two splits would overlap). Generators started with ``join``
(``hsgen generate --join``) share the work instead: they claim chunks of the input in
``<store>/.leases/claims`` (:mod:`hsgen.store.claims`); a joined and a plain generator refuse
each other, so a mistaken second run is still refused. The files a dead generator left in
the servers' shared directory are found by its prefix and removed at the next start or by
``hsgen gc --shared-dir DIR``; a dead lease is forgotten once it is older than ``KEEP_DEAD_S``
(a server may still write a killed client's last files for a moment). The directory starts with
a dot, so hsgen versions that do not know leases ignore it.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import secrets
import shutil
import socket
import time
from dataclasses import dataclass
from pathlib import Path

from hsgen.store.errors import StoreError
from hsgen.store.fsutil import is_locked, try_lock

log = logging.getLogger(__name__)

LEASE_DIR = ".leases"
CLAIMS_DIR = "claims"
"""Under ``LEASE_DIR``: the work claims of joined generators (reset when the first one joins)."""
KEEP_DEAD_S = 600.0
"""A dead lease is kept (and its prefix swept) for this long after its last heartbeat."""
HEARTBEAT_S = 30.0
"""How often a live lease's file is touched (its mtime tells how long ago it died)."""


class LeaseConflict(StoreError):
    """Another live generator fills the store with this rank, or with another world size."""


@dataclass(frozen=True)
class LeaseInfo:
    """One lease file as read back.

    Attributes:
        path: the lease file.
        live: whether its owner still holds the lock.
        age_s: seconds since the file was last touched (its heartbeat).
        request_prefix: start of the owner's request ids (and server file names).
        shared_dir: the servers' shared directory as the owner saw it.
        world_size, rank: the owner's split of the input.
        host, pid: where the owner runs.
    """

    path: Path
    live: bool
    age_s: float
    request_prefix: str
    shared_dir: str
    world_size: int
    rank: int
    host: str
    pid: int
    join: bool = False

    def describe(self) -> str:
        if self.join:
            return f"pid {self.pid} on {self.host}, joined (--join)"
        return f"pid {self.pid} on {self.host}, rank {self.rank} of --world-size {self.world_size}"


def read_leases(store_path: str | os.PathLike[str]) -> list[LeaseInfo]:
    """Every readable lease of the store (an unreadable one is skipped with a warning)."""
    d = Path(store_path) / LEASE_DIR
    try:
        names = sorted(n for n in os.listdir(d) if n.endswith(".json"))
    except FileNotFoundError:
        return []
    out = []
    now = time.time()
    for name in names:
        p = d / name
        try:
            doc = json.loads(p.read_bytes())
            mtime = p.stat().st_mtime
            out.append(
                LeaseInfo(
                    path=p,
                    live=is_locked(p),
                    age_s=max(0.0, now - mtime),
                    request_prefix=str(doc["request_prefix"]),
                    shared_dir=str(doc.get("shared_dir", "")),
                    world_size=int(doc["world_size"]),
                    rank=int(doc["rank"]),
                    host=str(doc.get("host", "?")),
                    pid=int(doc.get("pid", 0)),
                    join=bool(doc.get("join", False)),
                )
            )
        except FileNotFoundError:
            continue
        except (OSError, ValueError, KeyError, TypeError) as e:
            # a lease being written right now is locked and not yet complete: skip it quietly
            if not is_locked(p):
                log.warning("%s: unreadable lease (%s)", p, e)
    return out


class Lease:
    """A held lease; :meth:`release` when the run ends (the file stays, dead, for the sweep)."""

    def __init__(self, info: LeaseInfo, fd: int):
        self.info = info
        self._fd = fd
        self._last_touch = time.monotonic()

    @property
    def path(self) -> Path:
        return self.info.path

    def heartbeat(self, *, force: bool = False) -> None:
        """Touch the lease file (at most every ``HEARTBEAT_S`` unless ``force``)."""
        if self._fd < 0 or (not force and time.monotonic() - self._last_touch < HEARTBEAT_S):
            return
        self._last_touch = time.monotonic()
        with contextlib.suppress(OSError):
            os.utime(self._fd)

    def release(self) -> None:
        """Drop the lock (the lease becomes dead). Safe to call twice."""
        if self._fd >= 0:
            self.heartbeat(force=True)
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def acquire_lease(
    store_path: str | os.PathLike[str],
    *,
    world_size: int,
    rank: int,
    request_prefix: str,
    shared_dir: str = "",
    join: bool = False,
) -> Lease:
    """Take a lease on the store at ``store_path`` (created as a directory if missing).

    With ``join`` the lease shares the store with other joined ones (they split the work by
    claims); the first joined lease while no other is live clears the claims of earlier runs.

    Raises:
        LeaseConflict: a live lease has the same rank, or another world size; or one of the two
            is joined and the other is not.
        OSError: the store directory cannot be written (the message names it).
    """
    d = Path(store_path) / LEASE_DIR
    d.mkdir(parents=True, exist_ok=True)
    mutex = os.open(d / ".mutex", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        if not try_lock(mutex, attempts=200, delay=0.05):
            raise LeaseConflict(f"{d / '.mutex'}: still locked after 10 s (a generator is starting?)")
        live = [other for other in read_leases(store_path) if other.live]
        for other in live:
            if join != other.join:
                if join:
                    raise LeaseConflict(
                        f"{store_path} is being filled by a generator that did not --join ({other.describe()}): "
                        f"wait for it, or restart both with --join"
                    )
                raise LeaseConflict(
                    f"{store_path} is being filled by joined generators ({other.describe()}): "
                    f"add --join to help them, or wait"
                )
            if join:
                continue
            if other.world_size != world_size:
                raise LeaseConflict(
                    f"{store_path} is being filled with --world-size {other.world_size} ({other.describe()}): "
                    f"use the same --world-size, not {world_size}"
                )
            if other.rank == rank:
                raise LeaseConflict(
                    f"{store_path} is already being filled by rank {rank} ({other.describe()}): "
                    f"run several generators with --world-size N and a different --rank each, or wait"
                )
        if join and not live:
            shutil.rmtree(d / CLAIMS_DIR, ignore_errors=True)
        host = socket.gethostname()
        path = d / f"{host}-{os.getpid()}-{secrets.token_hex(4)}.json"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            doc = {
                "request_prefix": request_prefix,
                "shared_dir": os.path.abspath(shared_dir) if shared_dir else "",
                "world_size": world_size,
                "rank": rank,
                "host": host,
                "pid": os.getpid(),
                "started": round(time.time(), 3),
                "join": join,
            }
            os.write(fd, json.dumps(doc).encode() + b"\n")
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            path.unlink(missing_ok=True)
            raise
    finally:
        os.close(mutex)
    info = LeaseInfo(
        path, True, 0.0, request_prefix, doc["shared_dir"], world_size, rank, host, os.getpid(), join
    )
    return Lease(info, fd)


def sweep_dead_leases(
    store_path: str | os.PathLike[str],
    shared_dirs: list[str],
    *,
    keep_dead_s: float = KEEP_DEAD_S,
    dry_run: bool = False,
) -> dict[str, int]:
    """Remove the server files of the store's dead leases from ``shared_dirs``; forget old dead leases.

    Only files named after a dead lease's request prefix are touched: never those of a live
    generator or of any other client.

    Returns:
        ``orphans_removed`` (files and locks) and ``leases_removed``.
    """
    from hsgen.client.shared_dir import SharedDir, count_owned

    out = {"orphans_removed": 0, "leases_removed": 0}
    dead = [lease for lease in read_leases(store_path) if not lease.live]
    handles = []
    for path in dict.fromkeys(shared_dirs):
        sd = SharedDir(path)
        try:
            sd.fd()
        except OSError as e:
            if e.errno not in (errno.ENOENT, errno.ENOTDIR):
                log.warning("cannot open the shared directory %s: %s", path, e)
            continue
        handles.append(sd)
    try:
        for lease in dead:
            for sd in handles:
                if dry_run:
                    out["orphans_removed"] += count_owned(sd, lease.request_prefix)
                else:
                    n = sd.remove_owned(lease.request_prefix)
                    if n:
                        log.info(
                            "removed %d files left in %s by a dead client (%s)", n, sd.path, lease.describe()
                        )
                    out["orphans_removed"] += n
            if lease.age_s > keep_dead_s:
                out["leases_removed"] += 1
                if not dry_run:
                    lease.path.unlink(missing_ok=True)
    finally:
        for sd in handles:
            sd.close()
    return out


__all__ = [
    "CLAIMS_DIR",
    "HEARTBEAT_S",
    "KEEP_DEAD_S",
    "LEASE_DIR",
    "Lease",
    "LeaseConflict",
    "LeaseInfo",
    "acquire_lease",
    "read_leases",
    "sweep_dead_leases",
]
