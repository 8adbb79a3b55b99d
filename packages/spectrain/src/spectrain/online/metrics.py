"""Counters of an online run (:class:`OnlineMetrics`)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class OnlineMetrics:
    """Counters of an online run (all since construction).

    Attributes:
        samples_from_cache: samples read from the offline store that this epoch did not generate.
        samples_from_scratch: samples read from the scratch store that this epoch did not
            generate (kept from an earlier epoch, or left by a run that crashed).
        samples_generated: samples fetched from the servers and committed.
        samples_failed: samples that could not be produced (reported in the failures file).
        samples_consumed: samples whose optimizer step completed.
        samples_skipped: planned samples an epoch left untrained (the tail a rank drops so
            that ranks step together); deletable like consumed ones.
        shards_deleted: generated (or, with ``delete_cached``, cached) shards deleted.
        wait_seconds: time ``get`` blocked for a sample not ready yet.
        get_seconds: time spent in ``get`` in total (waiting + reading).
        scratch_bytes: bytes the scratch directory holds now.
        scratch_peak_bytes: most bytes the scratch directory ever held.
        scratch_bound_bytes: the configured bound.
        held_bytes: bytes of fetched samples held in memory now, to be read once into their
            batch (read-once mode; counted in the bound with the scratch store).
        held_peak_bytes: most bytes ever held in memory at once.
        in_flight: requests in flight now.
        overshoots: times a sample was fetched past the bound because the trainer waited on it.
        orphans_removed: files removed from the servers' shared directory that killed runs of
            this save path left there (or this run's own, of requests cancelled at its end).
    """

    samples_from_cache: int = 0
    samples_from_scratch: int = 0
    samples_generated: int = 0
    samples_failed: int = 0
    samples_consumed: int = 0
    samples_skipped: int = 0
    shards_deleted: int = 0
    wait_seconds: float = 0.0
    get_seconds: float = 0.0
    scratch_bytes: int = 0
    scratch_peak_bytes: int = 0
    scratch_bound_bytes: int = 0
    held_bytes: int = 0
    held_peak_bytes: int = 0
    in_flight: int = 0
    overshoots: int = 0
    orphans_removed: int = 0

    def as_dict(self) -> dict[str, float | int]:
        return dict(self.__dict__)
