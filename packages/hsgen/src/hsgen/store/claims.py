"""Work claims of joined generators: who requests which chunk of the input.

Generators started with ``--join`` read the same input in the same order and cut it into chunks
of ``chunk`` consecutive prompts. Before requesting the prompts of chunk ``c`` a generator claims
it: ``<store>/.leases/claims/<c>`` names the claimant's lease (created with an exclusive link, so
one of two racing generators wins). A chunk whose claimant's lease is dead (its process is gone:
the lease's ``flock`` went with it) and that is not marked done is taken over under the leases'
mutex, so a dead generator's work is picked up exactly once. ``<c>.done`` marks a chunk whose
prompts were all answered and committed; a generator that finishes its pass waits for the chunks
still held by live ones, and does the chunks of dead ones again (already stored ids cost no
request). The claims are cleared when a joined generator starts while no other is live.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import time
from pathlib import Path

from hsgen.store.errors import StoreError
from hsgen.store.fsutil import is_locked, try_lock
from hsgen.store.leases import CLAIMS_DIR, LEASE_DIR, Lease

log = logging.getLogger(__name__)

DEFAULT_CHUNK = 64
"""Prompts per claim: small enough to balance, large enough that claims cost nothing."""


def _create_exclusive(path: Path, data: bytes) -> bool:
    """Create ``path`` holding ``data`` unless it exists (a temp file hard-linked into place)."""
    tmp = path.with_name(f".{path.name}.tmp-{secrets.token_hex(4)}")
    tmp.write_bytes(data)
    try:
        os.link(tmp, path)
        return True
    except FileExistsError:
        return False
    finally:
        tmp.unlink(missing_ok=True)


class WorkClaims:
    """The claims one joined generator makes, and its view of everyone else's.

    Args:
        store_path: the store (its ``.leases`` directory holds the claims).
        lease: this generator's live lease (joined).
        chunk: prompts per claim; every joined generator of a store must use the same.
    """

    def __init__(self, store_path: str | os.PathLike[str], lease: Lease, chunk: int = DEFAULT_CHUNK):
        if chunk < 1:
            raise ValueError("the claim chunk must be >= 1 prompt")
        self.leases = Path(store_path) / LEASE_DIR
        self.dir = self.leases / CLAIMS_DIR
        self.dir.mkdir(parents=True, exist_ok=True)
        self.me = lease.path.name
        self.chunk = chunk
        self.mine: set[int] = set()
        """Chunks this generator claimed and has not marked done."""
        self.taken_over = 0
        self._live: dict[str, tuple[bool, float]] = {}

    def _owner_live(self, owner: str) -> bool:
        """Whether the lease ``owner`` is held (cached for a second)."""
        now = time.monotonic()
        hit = self._live.get(owner)
        if hit is not None and now - hit[1] < 1.0:
            return hit[0]
        live = owner == self.me or is_locked(self.leases / owner)
        self._live[owner] = (live, now)
        return live

    def _owner(self, c: int) -> str | None:
        try:
            return (self.dir / str(c)).read_text().strip() or None
        except FileNotFoundError:
            return None

    def done(self, c: int) -> bool:
        return (self.dir / f"{c}.done").exists()

    def claim(self, c: int) -> bool:
        """Claim chunk ``c``: True if it is now this generator's, False if it is done or live elsewhere."""
        if c in self.mine:
            return True
        path = self.dir / str(c)
        if _create_exclusive(path, self.me.encode()):
            self.mine.add(c)
            return True
        if self.done(c):
            return False
        owner = self._owner(c)
        if owner == self.me:
            self.mine.add(c)
            return True
        if owner is not None and self._owner_live(owner):
            return False
        return self._take_over(c)

    def _take_over(self, c: int) -> bool:
        """Take chunk ``c`` from a dead claimant, under the leases' mutex (one taker wins)."""
        fd = os.open(self.leases / ".mutex", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            if not try_lock(fd, attempts=200, delay=0.05):
                raise StoreError(f"{self.leases / '.mutex'}: still locked after 10 s")
            if self.done(c):
                return False
            owner = self._owner(c)
            self._live.pop(owner or "", None)
            if owner is not None and owner != self.me and self._owner_live(owner):
                return False
            tmp = self.dir / f".{c}.tmp-{secrets.token_hex(4)}"
            tmp.write_bytes(self.me.encode())
            os.replace(tmp, self.dir / str(c))
        finally:
            os.close(fd)
        log.info("chunk %d of a dead generator (%s) is now this one's", c, owner)
        self.taken_over += 1
        self.mine.add(c)
        return True

    def mark_done(self) -> int:
        """Mark every chunk claimed so far done (call once their samples are committed)."""
        n = 0
        for c in sorted(self.mine):
            with contextlib.suppress(FileExistsError):
                (self.dir / f"{c}.done").touch(exist_ok=False)
                n += 1
        self.mine.clear()
        return n

    def unfinished(self) -> tuple[set[int], int]:
        """Chunks not done: (those whose claimant is dead, how many live ones still hold)."""
        dead: set[int] = set()
        held = 0
        self._live.clear()
        try:
            names = os.listdir(self.dir)
        except FileNotFoundError:
            return dead, 0
        done = {n[: -len(".done")] for n in names if n.endswith(".done")}
        for name in names:
            if not name.isdigit() or name in done:
                continue
            owner = self._owner(int(name))
            if owner is not None and self._owner_live(owner):
                held += owner != self.me
            else:
                dead.add(int(name))
        return dead, held


__all__ = ["DEFAULT_CHUNK", "WorkClaims"]
