"""Which server files are an online run's: its request-id prefix, recorded in a lease beside its checkpoints.

vLLM names every hidden-state file after the request's ``X-Request-Id``; an online run sends ids
starting with one prefix of its own (``hsgen-<12 hex>-``, then ``t-`` for the training source's
requests and ``v-`` for the validation source's). :class:`RunLease` records the prefix in a lease
under ``<save_path>/.leases/`` (the same lease files ``hsgen generate`` keeps in a store:
:mod:`hsgen.store.leases`), locked while the run lives. A ``kill -9`` frees the lock, so the run
is then known dead, and its leftovers in the servers' shared directory (the files of requests in
flight when it died, written by the server after the death) are found by the prefix:

- the next run on the same ``--save-path`` (a resume) removes them when it starts, and again
  when it closes (a server may still finish a dead run's requests for a moment);
- ``hsgen gc SAVE_PATH --shared-dir DIR`` removes them without starting a run.

Only the files of dead runs' prefixes are ever removed: never a live run's, never another client's.
A run also removes its own leftovers (requests cancelled at its end) when it closes.
"""

from __future__ import annotations

import logging
from pathlib import Path

from hsgen.client.shared_dir import SharedDir, new_client_prefix
from hsgen.store.leases import Lease, LeaseConflict, acquire_lease, read_leases, sweep_dead_leases
from spectrain.online.config import OnlineConfig

log = logging.getLogger(__name__)


class RunLease:
    """The run's request-id prefix and its lease in ``<save_path>/.leases`` (see the module docstring).

    Without a save path there is no lease: the run still removes its own leftovers when it closes.

    Raises:
        RuntimeError: a live run of the same rank (or another world size) uses the save path.
    """

    def __init__(self, config: OnlineConfig):
        self.config = config
        self.prefix = new_client_prefix()
        self.base = Path(config.save_path) if config.save_path else None
        self.lease: Lease | None = None
        self.orphans_removed = 0
        if self.base is None:
            return
        try:
            self.lease = acquire_lease(
                self.base, world_size=config.world_size, rank=config.rank, request_prefix=self.prefix,
                shared_dir=config.shared_dir,
            )  # fmt: skip
        except LeaseConflict as e:
            raise RuntimeError(f"--save-path {self.base} is in use by another online run: {e}") from None
        self.sweep()

    def client_prefix(self, split: str) -> str:
        """The request-id prefix of the source reading ``split``."""
        return f"{self.prefix}{'t' if split == 'train' else 'v'}-"

    def sweep(self) -> int:
        """Remove the server files of dead runs of this save path; returns how many."""
        if self.base is None:
            return 0
        dirs = [self.config.shared_dir] + [i.shared_dir for i in read_leases(self.base) if i.shared_dir]
        n = sweep_dead_leases(self.base, dirs)["orphans_removed"]
        if n:
            log.info("removed %d server files left by killed runs of %s", n, self.base)
        self.orphans_removed += n
        return n

    def heartbeat(self) -> None:
        """Touch the lease (rate-limited): its age tells how long ago a dead run stopped."""
        if self.lease is not None:
            self.lease.heartbeat()

    def remove_own(self, prefix: str | None) -> int:
        """Remove the files of one of this run's sources (its requests cancelled at the end)."""
        if not prefix:
            return 0
        shared = SharedDir(self.config.shared_dir)
        try:
            n = shared.remove_owned(prefix)
        except OSError as e:
            log.warning("cannot clean the shared directory %s: %s", self.config.shared_dir, e)
            n = 0
        finally:
            shared.close()
        self.orphans_removed += n
        return n

    def close(self, own_prefix: str | None) -> None:
        """Remove this run's own leftovers and dead runs' late ones, then release the lease."""
        try:
            self.remove_own(own_prefix)
            self.sweep()
        finally:
            if self.lease is not None:
                self.lease.release()
