"""The online sample source: :class:`OnlineSource`, the ``SampleSource`` the trainer sees.

It wires the units of the online data path, each in its own module:

- :mod:`~spectrain.online.prompts` (``PromptSet``): the prompts, their split, the renderer;
- :mod:`~spectrain.online.fetcher` (``Fetcher``): prompt -> request -> validated file, on an
  asyncio thread, paced like ``hsgen generate``;
- :mod:`~spectrain.online.landing` (``Lander``): file -> shard of the scratch store (or memory);
- :mod:`~spectrain.online.stores` (``OnlineStores``): the user's store and the scratch store;
- :mod:`~spectrain.online.ledger` (``SampleLedger``): where each sample is, and the byte bound;
- :mod:`~spectrain.online.reading` (``SampleReader``): the trainer's blocking reads;
- :mod:`~spectrain.online.retention` (``Retention``): deletion after the optimizer step;
- :mod:`~spectrain.online.run_lease` (``RunLease``): the run's request-id prefix, and the
  server files of killed runs found by theirs.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import os
import shutil
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from hsgen.store import Sample, StoreHeader
from spectrain.data.sample_reads import SampleRead
from spectrain.data.sources import epoch_plan
from spectrain.online.config import OnlineConfig
from spectrain.online.fetcher import Fetcher
from spectrain.online.landing import Lander
from spectrain.online.ledger import SampleLedger
from spectrain.online.logs import ConsumedLog, FailureLog
from spectrain.online.metrics import OnlineMetrics
from spectrain.online.prompts import PromptSet
from spectrain.online.reading import SampleReader
from spectrain.online.retention import Retention
from spectrain.online.run_lease import RunLease
from spectrain.online.scratch import dir_bytes
from spectrain.online.stores import OnlineStores

log = logging.getLogger(__name__)


class OnlineSource:
    """A :class:`spectrain.data.sources.SampleSource` that completes a store online from vLLM servers.

    Thread model: ``plan``/``get``/``locate``/``consumed``/``close`` are called from the trainer's
    threads; fetching runs on a private asyncio thread; store writes and deletions on one I/O thread.
    """

    lengths_exact = False  # a prompt's length costs a rendering: the trainer samples long plans
    locate_waits = True  # locate() waits for fetches: the loader copies each sample as soon as it is placed

    def __init__(
        self,
        config: OnlineConfig | Any,
        *,
        rank: int | None = None,
        world_size: int | None = None,
        plan_fn: Callable[[Sequence[str], int], list[str]] | None = None,
        client_factory: Callable[[], Any] | None = None,
        inputs: dict[str, Any] | None = None,
        run: RunLease | None = None,
    ):
        """Read the prompts, open the stores and start the fetch thread.

        Args:
            config: an :class:`OnlineConfig`, or a ``TrainConfig`` (see :meth:`OnlineConfig.from_train_config`).
            rank, world_size: override the config's (``TrainConfig`` has none: default 0 and 1).
            plan_fn: ``(all train ids, epoch) -> this rank's ordered ids``; default
                :func:`spectrain.data.sources.epoch_plan` with the config's seed, rank and world size
                (the offline plan, so a store and its prompts give the same epochs).
            client_factory: builds the async client (``HiddenStateClient`` from the config by default).
            inputs: the prompts already read, by sample id (the validation source shares the
                training source's, so ``--prompts -`` reads stdin once); default: read ``config.prompts``.
            run: the run's lease (the validation source shares the training source's); default:
                take one in ``<save_path>/.leases``, removing the server files of killed runs.
        """
        if not isinstance(config, OnlineConfig):
            config = OnlineConfig.from_train_config(config, rank or 0, world_size or 1)
        else:
            config = dataclasses.replace(
                config,
                rank=config.rank if rank is None else rank,
                world_size=config.world_size if world_size is None else world_size,
            )
        config.validate()
        self.config = config
        self.metrics = OnlineMetrics(scratch_bound_bytes=config.scratch_bytes)
        self._plan_fn = plan_fn or (
            lambda ids, epoch: epoch_plan(ids, epoch, config.seed, config.rank, config.world_size)
        )
        self._owns_run = run is None
        self.run = run if run is not None else RunLease(config)
        self._closed = False
        try:
            self._start(client_factory, inputs)
        except BaseException:
            if self._owns_run:
                self.run.close(None)
            raise

    def _start(self, client_factory: Callable[[], Any] | None, inputs: dict[str, Any] | None) -> None:
        config = self.config
        self._client_factory_arg = client_factory
        self.prompts = PromptSet(config, inputs)
        self.train_ids = self.prompts.train_ids
        self.validation_ids = self.prompts.validation_ids
        self.split_ids = self.prompts.split_ids
        self._lengths: dict[str, int] = {}
        self._plans: dict[int, list[str]] = {}
        self._resume_ids: list[str] | None = None
        self.stores = OnlineStores(config, self.prompts.fingerprint)
        self._failures = FailureLog(config)
        self._consumed_log = ConsumedLog(config, f"{os.getpid()}-{int(time.time() * 1000)}")
        self.ledger = SampleLedger(config, self.stores, self.metrics, self._failures, self.prompts.source_of)
        self._io = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="online-io")
        self._deletions = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="online-delete")
        self.retention = Retention(config, self.stores, self.ledger, self.metrics, self._deletions)
        self.lander = Lander(config, self.stores, self.ledger, self.metrics, self.retention, self._io)
        self.reader = SampleReader(self.stores, self.ledger, self.retention, self.metrics)
        self.fetcher = Fetcher(
            config, self.prompts, self.stores, self.ledger, self.lander, self.metrics, self._io,
            client_factory=client_factory, first_ids=self._first_ids, open_scratch=self._open_scratch,
            request_prefix=self.run.client_prefix(config.split), heartbeat=self.run.heartbeat,
        )  # fmt: skip
        self.fetcher.start()
        if self.stores.header is not None:
            self._open_scratch()

    def _first_ids(self) -> list[str]:
        """What this rank trains first (the header probe's samples get trained): where a resumed run
        starts (:meth:`resume_at`), else its first epoch, planned now if no epoch is."""
        if self._resume_ids is not None:
            return self._resume_ids
        with self.ledger.lock:
            ep = self.ledger.epoch
        if ep is not None:  # planned, not started yet
            return list(ep.ids)
        return self._plans.setdefault(0, list(self._plan_fn(self.split_ids, 0)))

    def resume_at(self, epoch: int, position: int, plan: Sequence[str] | None = None) -> None:
        """The trainer resumes ``epoch`` at ``position`` of ``plan`` (default: the epoch's own plan);
        told before :attr:`header`, so a new store's header probe fetches a sample the run trains."""
        ids = list(plan) if plan is not None else list(self._plan_fn(self.split_ids, epoch))
        self._resume_ids = ids[position:] or None

    def _open_scratch(self) -> None:
        cfg = self.config
        if cfg.delete_consumed:
            need, what = cfg.scratch_bytes, "the scratch bound (scratch_bytes) is"
        else:
            need, what = self._estimate_total_bytes(), "this rank's samples need about"
        sizes = self.stores.open_scratch(need, what)
        with self.ledger.lock:
            self.ledger.sizes.update(sizes)
        self.retention.update_scratch_usage()

    def _estimate_total_bytes(self) -> int:
        """Rough bytes of all this rank's samples (4 chars per token for text samples)."""
        mine = self.split_ids[self.config.rank :: self.config.world_size]
        return sum(self.stores.bytes_for(n) for n in self.prompts.rough_tokens(mine))

    @property
    def header(self) -> StoreHeader:
        """What the samples mean (the store's header; probed from the first fetch for a new store)."""
        if self.stores.header is None:
            self.fetcher.probe_header()
        assert self.stores.header is not None
        return self.stores.header

    @property
    def scratch_path(self) -> Path | None:
        """The scratch store's directory (None until the header is known)."""
        return self.stores.scratch_path

    # ------------------------------------------------------------------ SampleSource

    def plan(self, epoch: int) -> list[str]:
        """This rank's ordered sample ids for ``epoch``; also makes ``epoch`` the active one."""
        if epoch not in self._plans:
            self._plans[epoch] = list(self._plan_fn(self.split_ids, epoch))
        ids = self._plans[epoch]
        with self.ledger.lock:
            ep = self.ledger.epoch
            leaving = ep if ep is not None and ep.epoch != epoch else None
        if leaving is not None and leaving.started and self.retention.active:
            # The trainer asks for epoch e + 1 after its last consumed() of epoch e. Finish epoch e's
            # deletions now (after any pass still queued): run later, they would be judged against
            # the new plan, and samples the new epoch had counted as ready could vanish after later
            # ones filled the scratch bound.
            self.retention.run_now()
        with self.ledger.cond:
            if self.ledger.begin_epoch(epoch, ids):
                if leaving is not None and leaving.started:  # its untrained read-once samples: not now
                    self.ledger.release_held()  # (planning epochs ahead keeps the header probe's sample)
                self.stores.refresh_main()
        return list(ids)

    def get(self, sample_id: str) -> Sample | None:
        """The sample, blocking until it is committed; None when it cannot be produced (reported)."""
        return self.reader.get(sample_id)

    def locate(self, sample_id: str) -> SampleRead | None:
        """The sample's read for the loader (straight into its batch), blocking until it is ready."""
        return self.reader.locate(sample_id)

    def refused(self, sample_id: str, reason: str) -> None:
        """The loader refused a located sample (checksum, non-finite values): reported as failed."""
        self.reader.refused(sample_id, reason)

    def consumed(self, sample_ids: Sequence[str]) -> None:
        """Mark samples as trained (their optimizer step completed); delete what is no longer needed."""
        ids = list(sample_ids)
        epoch, start_pos, positions = self.ledger.mark_consumed(ids)
        self._consumed_log.write(epoch, start_pos, positions, ids)
        if self.retention.active:
            self.retention.request()
        self.fetcher.wake()

    def skipped(self, sample_ids: Sequence[str]) -> None:
        """Mark planned samples this epoch leaves untrained: generated ones become deletable like
        consumed ones; cached ones are not (``delete_cached`` deletes only what was trained)."""
        self.ledger.mark_skipped(sample_ids)
        if self.retention.active:
            self.retention.request()
        self.fetcher.wake()

    def close(self) -> None:
        """Stop fetching, commit nothing more, release the client; remove an empty scratch store."""
        if self._closed:
            return
        self._closed = True
        with self.ledger.cond:
            self.ledger.closed = True
            self.ledger.release_held()
            self.ledger.cond.notify_all()
        self.fetcher.stop()
        try:
            self._io.submit(self.lander.close_writers).result()
            if not self.config.cache_generated:
                self.retention.run_now(closing=True)
        finally:
            self._io.shutdown(wait=True)
            self._deletions.shutdown(wait=True)
            self._failures.close()
            self._consumed_log.close()
            if self._owns_run:
                self.run.close(self.fetcher.client_prefix)
            else:
                self.run.remove_own(self.fetcher.client_prefix)
        self._remove_scratch()

    def discard_scratch(self) -> None:
        """Have :meth:`close` remove the scratch store whatever it holds (a run that failed)."""
        self._discard = True

    def _scratch_candidates(self) -> list[Path]:
        """Where this run's scratch store is (not opened yet: an earlier run's, if it left one)."""
        from spectrain.online.scratch import SCRATCH_MARKER, scratch_dirs

        cfg = self.config
        if cfg.scratch_dir:
            paths = [Path(cfg.scratch_dir) / (f"rank{cfg.rank}" if cfg.world_size > 1 else "")]
        else:  # nothing is chosen (nor logged): both places are looked at
            paths = list(scratch_dirs(cfg.save_path, cfg.rank, split=cfg.split))
        return [p for p in dict.fromkeys(paths) if (p / SCRATCH_MARKER).exists()]

    def _remove_scratch(self) -> None:
        path, scratch = self.stores.scratch_path, self.stores.scratch
        if getattr(self, "_discard", False):
            for p in [path] if path is not None else self._scratch_candidates():
                shutil.rmtree(p, ignore_errors=True)
                log.info("removed the scratch store %s (the run failed)", p)
        elif path is not None and self.config.split == "validation" and not self.config.cache_generated:
            shutil.rmtree(path, ignore_errors=True)  # cheap to fetch again; never left in RAM
        elif path is not None and scratch is not None:
            with self.stores.scratch_lock:
                scratch.refresh()
                empty = len(scratch) == 0
            if empty:
                shutil.rmtree(path, ignore_errors=True)
                log.info("removed the empty scratch store %s", path)
            else:
                log.info(
                    "scratch store %s keeps %d samples (%.2f GB)", path, len(scratch), dir_bytes(path) / 1e9
                )

    def use_plan(self, epoch: int, sample_ids: Sequence[str]) -> None:
        """Use a checkpointed plan for ``epoch`` (a resume whose prompts changed since)."""
        ids = list(sample_ids)
        self._plans[epoch] = ids
        with self.ledger.cond:
            self.ledger.epoch = None
            self.ledger.begin_epoch(epoch, ids)
        self.stores.refresh_main()

    def rendered(self, sample_id: str):
        """The sample's :class:`hsgen.inputs.render.RenderedPrompt` (rendered locally, nothing fetched)."""
        return self.prompts.render(sample_id)

    def token_ids(self, sample_id: str):
        """``(token_ids, loss_mask)`` from rendering alone (None if it cannot be rendered)."""
        return self.prompts.token_ids(sample_id)

    def lengths(self, sample_ids: Sequence[str]) -> list[int]:
        """Token counts (stored length when the store has the sample, else rendered; 0 if unrenderable)."""
        out = []
        for sid in sample_ids:
            n = self._lengths.get(sid)
            if n is None:
                n = self.stores.main_length(sid)
                if n is None:
                    got = self.prompts.token_ids(sid)
                    n = 0 if got is None else int(got[0].shape[0])
                self._lengths[sid] = n
            out.append(n)
        return out

    def ids(self) -> list[str]:
        """Sorted ids of this source's split, all ranks (for token counting; nothing is fetched)."""
        return sorted(self.split_ids)

    def validation_source(self) -> OnlineSource | None:
        """A source over the validation split (its own fetch thread and scratch; keeps what it fetched)."""
        if not self.validation_ids or self.config.split != "train":
            return None
        cfg = dataclasses.replace(
            self.config,
            split="validation",
            delete_consumed=False,
            delete_cached=False,
            persist_fetched=True,
            scratch_dir=None if self.config.scratch_dir is None else self.config.scratch_dir + "-validation",
            failures_path=None,
        )
        return OnlineSource(
            cfg,
            plan_fn=None,
            client_factory=self._client_factory_arg,
            inputs=self.prompts.inputs,
            run=self.run,
        )

    def __enter__(self) -> OnlineSource:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def stats(self) -> dict[str, float | int]:
        """The counters of :class:`OnlineMetrics`, for the trainer's metrics log."""
        with self.ledger.lock:
            self.metrics.in_flight = len(self.ledger.inflight)
            self.metrics.orphans_removed = self.run.orphans_removed
            return self.metrics.as_dict()

    @property
    def failures_path(self) -> Path:
        """The JSONL file listing samples that could not be produced."""
        return self._failures.path
