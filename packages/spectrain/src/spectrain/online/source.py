"""The online sample source: :class:`OnlineSource` and its private epoch and error types."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import json
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hsgen.store import HiddenStateStore, Sample, StoreError, StoreHeader
from spectrain.data import epoch_plan, split_of
from spectrain.online.config import OnlineConfig
from spectrain.online.metrics import OnlineMetrics
from spectrain.online.scratch import PER_SAMPLE_OVERHEAD, choose_scratch_dir, dir_bytes, open_scratch_store

log = logging.getLogger(__name__)


@dataclass
class _Epoch:
    epoch: int
    ids: list[str]
    pos: dict[str, int]
    started: bool = False
    start_pos: int = 0
    cursor: int = 0
    consumed: set[str] = field(default_factory=set)
    skipped: set[str] = field(default_factory=set)  # left untrained this epoch (see skipped())
    failed: dict[str, str] = field(default_factory=dict)


class OnlineSource:
    """A :class:`spectrain.data.SampleSource` that completes a store online from vLLM servers.

    Thread model: ``plan``/``get``/``consumed``/``close`` are called from the training thread;
    fetching runs on a private asyncio thread; store writes and deletions on one I/O thread.
    """

    lengths_exact = False  # a prompt's length costs a rendering: the trainer samples long plans

    def __init__(
        self,
        config: OnlineConfig | Any,
        *,
        rank: int | None = None,
        world_size: int | None = None,
        plan_fn: Callable[[Sequence[str], int], list[str]] | None = None,
        client_factory: Callable[[], Any] | None = None,
        inputs: dict[str, Any] | None = None,
    ):
        """Read the prompts, open the stores and start the fetch thread.

        Args:
            config: an :class:`OnlineConfig`, or a ``TrainConfig`` (see :meth:`OnlineConfig.from_train_config`).
            rank, world_size: override the config's (``TrainConfig`` has none: default 0 and 1).
            plan_fn: ``(all train ids, epoch) -> this rank's ordered ids``; default
                :func:`spectrain.data.epoch_plan` with the config's seed, rank and world size
                (the offline plan, so a store and its prompts give the same epochs).
            client_factory: builds the async client (``HiddenStateClient`` from the config by default).
            inputs: the prompts already read, by sample id (the validation source shares the
                training source's, so ``--prompts -`` reads stdin once); default: read ``config.prompts``.
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
        self._client_factory_arg = client_factory
        self._client_factory = client_factory or self._default_client
        self._load_prompts(inputs)
        self._lock = threading.RLock()
        self._cond = threading.Condition(self._lock)
        self._store_lock = threading.RLock()
        self._scratch_lock = threading.RLock()
        self._open_main_store()
        self._header: StoreHeader | None = self._store.header if self._store is not None else None
        self._check_fingerprint()
        self._scratch: HiddenStateStore | None = None
        self._scratch_writer = None
        self._main_writer = None
        self._scratch_path: Path | None = None
        self._epoch: _Epoch | None = None
        self._plans: dict[int, list[str]] = {}
        self._ready: dict[str, str] = {}  # id -> "store" | "scratch"
        self._sizes: dict[str, int] = {}  # committed scratch sample -> bytes
        self._inflight: dict[str, int] = {}  # id -> reserved bytes
        self._buffered: dict[str, int] = {}  # id -> bytes, added to a writer, not committed
        self._buffered_since: float | None = None
        self._rendered: dict[str, Any] = {}
        self._waiting: set[str] = set()
        self._fatal: BaseException | None = None
        self._closed = False
        self._failures_file = None
        self._last_refresh = 0.0
        self._store_bad: set[str] = set()
        # Deletion is per shard, so a shard that holds consumed samples next to unconsumed ones
        # keeps them all: shards small against the bound keep that overhang small.
        self._scratch_shard_bytes = config.shard_bytes or max(
            256 << 10, min(8 << 20, config.scratch_bytes // 8)
        )
        self._delete_pending = False
        self._last_consumed = time.monotonic()
        self._step_interval = 0.0
        self._warned_bound = False
        self._fresh: set[str] = set()
        self._scratch_overhead = 0
        self._run_id = f"{os.getpid()}-{int(time.time() * 1000)}"
        self._consumed_file = None
        self._probe_lock: asyncio.Lock | None = None
        self._io = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="online-io")
        self._render_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="online-render")
        self._loop = asyncio.new_event_loop()
        self._wake: asyncio.Event | None = None
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._thread_main, name="online-fetch", daemon=True)
        self._thread.start()
        self._started.wait()
        if self._header is not None:
            self._open_scratch()

    # ------------------------------------------------------------------ set-up

    def _load_prompts(self, inputs: dict[str, Any] | None) -> None:
        from hsgen.inputs import read_inputs
        from hsgen.render import ChatRenderer, RenderConfig

        self._inputs: dict[str, Any] = {}
        if inputs is not None:
            self._inputs = inputs
        else:
            for sample in read_inputs(self.config.prompt_inputs(), on_bad_input="fail"):
                if sample.sample_id in self._inputs:
                    log.warning(
                        "%s: duplicate sample id %r: the first one is used", sample.source, sample.sample_id
                    )
                    continue
                self._inputs[sample.sample_id] = sample
        if not self._inputs:
            raise ValueError(f"--prompts {self.config.prompts}: no samples")
        frac = self.config.validation_fraction
        self.train_ids = [i for i in self._inputs if split_of(i, frac) == "train"]
        self.validation_ids = [i for i in self._inputs if split_of(i, frac) == "validation"]
        self.split_ids = self.train_ids if self.config.split == "train" else self.validation_ids
        if not self.split_ids:
            raise ValueError(f"--prompts {self.config.prompts}: no samples in the {self.config.split} split")
        self._lengths: dict[str, int] = {}
        self._renderer = ChatRenderer(
            RenderConfig(
                tokenizer_path=self.config.verifier if os.path.isdir(self.config.verifier) else None,
                chat_template=self.config.chat_template,
                template_kwargs=dict(self.config.template_kwargs),
                max_len=self.config.max_len,
                on_too_long=self.config.on_too_long,  # type: ignore[arg-type]
            )
        )

    def _open_main_store(self) -> None:
        path = Path(self.config.store)
        self._store: HiddenStateStore | None = None
        self._store_refused = False
        try:
            self._store = HiddenStateStore.open(path)
        except StoreError:
            if path.exists() and any(path.iterdir()):
                raise
            log.info("%s is not a store yet: every sample will be fetched online", path)

    def _check_fingerprint(self) -> None:
        have = self._header.tokenizer_fingerprint if self._header else ""
        mine = self._renderer.fingerprint
        if have and mine and have != mine:
            raise StoreError(
                f"{self.config.store}: its tokenizer fingerprint {have[:12]}... differs from the verifier's "
                f"tokenizer + chat template at {self.config.verifier} ({mine[:12]}...): the prompts would "
                "render to other token ids than the stored ones"
            )

    def _default_client(self):
        from hsgen.client import ClientConfig, HiddenStateClient

        opts = dict(self.config.client_options)
        opts.setdefault("endpoints", list(self.config.endpoints))
        opts.setdefault("shared_dir", self.config.shared_dir)
        if self.config.api_key is not None:
            opts.setdefault("api_key", self.config.api_key)
        return HiddenStateClient(ClientConfig(**opts))

    def _make_header(self, hidden_size: int, num_layers: int, dtype: str) -> StoreHeader:
        ids = self.config.layer_ids
        if not ids:
            raise ValueError(
                f"{self.config.store} is not a store yet: pass the servers' layer ids "
                "(--online-option layer_ids=[...]) so the scratch store's header says what the states mean"
            )
        if len(ids) != num_layers:
            raise ValueError(
                f"the server returned {num_layers} layers but the layer ids asked for are {ids}: pass the "
                "servers' layer ids, e.g. --online-option layer_ids=[2,18,33,36] (or --target-layer-ids)"
            )
        return StoreHeader(
            verifier=self.config.verifier,
            layer_ids=tuple(sorted(ids)),
            hidden_size=hidden_size,
            dtype=dtype,
            tokenizer_fingerprint=self._renderer.fingerprint,
        )

    def _open_scratch(self) -> None:
        assert self._header is not None
        cfg = self.config
        if cfg.scratch_dir:
            # one store per rank: a rank deletes shards holding none of its planned samples
            path = Path(cfg.scratch_dir)
            if cfg.world_size > 1:
                path = path / f"rank{cfg.rank}"
        else:
            need = cfg.scratch_bytes if cfg.delete_consumed else self._estimate_total_bytes()
            path = choose_scratch_dir(cfg.save_path, cfg.rank, need, split=cfg.split)
        scratch = open_scratch_store(path, self._header)
        self._scratch = scratch
        self._scratch_path = path
        self._scratch_writer = scratch.writer(f"online-rank{cfg.rank}-{os.getpid()}", shard_bytes=1 << 62)
        for sid in scratch.sample_ids():
            rec = scratch.record(sid)
            self._sizes[sid] = self._bytes_for(rec.length)
        if self._sizes:
            log.info(
                "scratch %s holds %d samples from an earlier run: they are read, not fetched",
                path,
                len(self._sizes),
            )
        self._update_scratch_usage()
        log.info("online scratch store: %s (bound %.2f GB)", path, cfg.scratch_bytes / 1e9)
        if cfg.cache_generated:
            if self._store is None:
                self._store = HiddenStateStore.create(Path(cfg.store), self._header, exist_ok=True)
            self._main_writer = self._store.writer(
                f"online-rank{cfg.rank}-{os.getpid()}", shard_bytes=1 << 62
            )

    def _bytes_for(self, tokens: int) -> int:
        h = self._header
        assert h is not None
        item = 4 if h.dtype == "float32" else 2
        return tokens * (h.num_layers * h.hidden_size * item + 9) + PER_SAMPLE_OVERHEAD

    def _estimate_total_bytes(self) -> int:
        """Rough bytes of all this rank's samples (4 chars per token for text samples)."""
        total = 0
        for sid in self.split_ids[self.config.rank :: self.config.world_size]:
            s = self._inputs[sid]
            if s.input_ids is not None:
                n = len(s.input_ids)
            else:
                text = s.prompt or json.dumps([dict(m) for m in s.messages or ()])
                n = len(text) // 4 + 8
            total += self._bytes_for(n)
        return total

    @property
    def header(self) -> StoreHeader:
        """What the samples mean (the store's header; probed from the first fetch for a new store)."""
        if self._header is None:
            fut = asyncio.run_coroutine_threadsafe(self._probe_header(), self._loop)
            fut.result()
        assert self._header is not None
        return self._header

    @property
    def scratch_path(self) -> Path | None:
        """The scratch store's directory (None until the header is known)."""
        return self._scratch_path

    # ------------------------------------------------------------------ SampleSource

    def plan(self, epoch: int) -> list[str]:
        """This rank's ordered sample ids for ``epoch``; also makes ``epoch`` the active one."""
        if epoch not in self._plans:
            self._plans[epoch] = list(self._plan_fn(self.split_ids, epoch))
        ids = self._plans[epoch]
        with self._lock:
            leaving = self._epoch if self._epoch is not None and self._epoch.epoch != epoch else None
        if (
            leaving is not None
            and leaving.started
            and (self.config.delete_consumed or self.config.delete_cached)
        ):
            # The trainer asks for epoch e + 1 after its last consumed() of epoch e. Finish epoch e's
            # deletions now, on the I/O thread (after any job still queued there): run later, they
            # would be judged against the new plan, and samples the new epoch had counted as ready
            # could vanish after later ones filled the scratch bound.
            self._io.submit(self._delete_consumed_shards).result()
        with self._cond:
            if self._epoch is None or self._epoch.epoch != epoch:
                if self._epoch is not None and self._epoch.started:
                    self._fresh = set()
                self._epoch = _Epoch(epoch, ids, {sid: i for i, sid in enumerate(ids)})
                self._refresh_main(force=True)
        return list(ids)

    def get(self, sample_id: str) -> Sample | None:
        """The sample, blocking until it is committed; None when it cannot be produced (reported)."""
        t0 = time.perf_counter()
        waited = 0.0
        try:
            while True:
                with self._cond:
                    self._note_position(sample_id)
                    loc = self._wait_located(sample_id, t0)
                    waited = time.perf_counter() - t0
                if loc is None:
                    return None
                sample = self._read(sample_id, loc)
                if sample is not None:
                    return sample
        finally:
            total = time.perf_counter() - t0
            with self._lock:
                self.metrics.wait_seconds += waited
                self.metrics.get_seconds += total

    def consumed(self, sample_ids: Sequence[str]) -> None:
        """Mark samples as trained (their optimizer step completed); delete what is no longer needed."""
        ids = list(sample_ids)
        with self._cond:
            ep = self._epoch
            for sid in ids:
                if ep is not None:
                    ep.consumed.add(sid)
                self.metrics.samples_consumed += 1
            self._log_consumed(ep, ids)
            now = time.monotonic()
            gap = now - self._last_consumed
            self._step_interval = gap if not self._step_interval else 0.8 * self._step_interval + 0.2 * gap
            self._last_consumed = now
        if self.config.delete_consumed or self.config.delete_cached:
            self._request_delete()
        self._wake_loop()

    def skipped(self, sample_ids: Sequence[str]) -> None:
        """Mark planned samples this epoch leaves untrained: generated ones become deletable like
        consumed ones; cached ones are not (``delete_cached`` deletes only what was trained)."""
        with self._cond:
            ep = self._epoch
            if ep is not None:
                ep.skipped.update(sample_ids)
            self.metrics.samples_skipped += len(sample_ids)
        if self.config.delete_consumed or self.config.delete_cached:
            self._request_delete()
        self._wake_loop()

    def _log_consumed(self, ep: _Epoch | None, ids: list[str]) -> None:
        """Append one line per step to ``online-consumed-rank<r>.jsonl`` (audit: each sample once per epoch)."""
        if self.config.save_path is None or self.config.split != "train":
            return
        if self._consumed_file is None:
            path = Path(self.config.save_path) / f"online-consumed-rank{self.config.rank}.jsonl"
            path.parent.mkdir(parents=True, exist_ok=True)
            self._consumed_file = open(path, "a", encoding="utf-8")  # noqa: SIM115
        positions = [ep.pos.get(i, -1) for i in ids] if ep is not None else []
        rec = {
            "run": self._run_id,
            "epoch": ep.epoch if ep is not None else -1,
            "start_pos": ep.start_pos if ep is not None else 0,
            "positions": positions,
            "ids": ids,
        }
        self._consumed_file.write(json.dumps(rec) + "\n")
        self._consumed_file.flush()

    def _request_delete(self) -> None:
        with self._lock:
            if self._delete_pending or self._closed:
                return
            self._delete_pending = True
        self._io.submit(self._delete_job)

    def _delete_job(self) -> None:
        with self._lock:
            self._delete_pending = False
        try:
            self._delete_consumed_shards()
        except Exception as e:
            log.exception("deleting consumed shards failed")
            self._set_fatal(e)

    def close(self) -> None:
        """Stop fetching, commit nothing more, release the client; remove an empty scratch store."""
        if self._closed:
            return
        self._closed = True
        self._wake_loop()
        self._thread.join(timeout=60)
        if self._thread.is_alive():
            log.warning("the online fetch thread did not stop within 60 s")
        try:
            for writer in (self._scratch_writer, self._main_writer):
                if writer is not None:
                    self._io.submit(self._close_writer, writer).result()
            if not self.config.cache_generated:
                self._io.submit(self._delete_consumed_shards, True).result()
        finally:
            self._io.shutdown(wait=True)
            self._render_pool.shutdown(wait=True)
            for f in (self._failures_file, self._consumed_file):
                if f is not None:
                    f.close()
        path = self._scratch_path
        if path is not None and self.config.split == "validation" and not self.config.cache_generated:
            shutil.rmtree(path, ignore_errors=True)  # cheap to fetch again; never left in RAM
        elif path is not None and self._scratch is not None:
            with self._scratch_lock:
                self._scratch.refresh()
                empty = len(self._scratch) == 0
            if empty:
                shutil.rmtree(path, ignore_errors=True)
                log.info("removed the empty scratch store %s", path)
            else:
                log.info(
                    "scratch store %s keeps %d samples (%.2f GB)",
                    path,
                    len(self._scratch),
                    dir_bytes(path) / 1e9,
                )

    def use_plan(self, epoch: int, sample_ids: Sequence[str]) -> None:
        """Use a checkpointed plan for ``epoch`` (a resume whose prompts changed since)."""
        ids = list(sample_ids)
        self._plans[epoch] = ids
        with self._cond:
            self._epoch = _Epoch(epoch, ids, {sid: i for i, sid in enumerate(ids)})
        self._refresh_main(force=True)

    def rendered(self, sample_id: str):
        """The sample's :class:`hsgen.render.RenderedPrompt` (rendered locally, nothing fetched)."""
        return self._renderer.render(self._inputs[sample_id])

    def token_ids(self, sample_id: str):
        """``(token_ids, loss_mask)`` from rendering alone (None if it cannot be rendered)."""
        import numpy as np

        from hsgen.render import RenderError

        try:
            p = self.rendered(sample_id)
        except RenderError:
            return None
        return np.asarray(p.token_ids, dtype=np.int64), np.asarray(p.loss_mask, dtype=np.uint8)

    def lengths(self, sample_ids: Sequence[str]) -> list[int]:
        """Token counts (stored length when the store has the sample, else rendered; 0 if unrenderable)."""
        out = []
        for sid in sample_ids:
            n = self._lengths.get(sid)
            if n is None:
                with self._store_lock:
                    if self._store is not None and sid in self._store:
                        n = self._store.record(sid).length
                if n is None:
                    got = self.token_ids(sid)
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
            scratch_dir=None if self.config.scratch_dir is None else self.config.scratch_dir + "-validation",
            failures_path=None,
        )
        return OnlineSource(cfg, plan_fn=None, client_factory=self._client_factory_arg, inputs=self._inputs)

    def __enter__(self) -> OnlineSource:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def stats(self) -> dict[str, float | int]:
        """The counters of :class:`OnlineMetrics`, for the trainer's metrics log."""
        with self._lock:
            self.metrics.in_flight = len(self._inflight)
            return self.metrics.as_dict()

    # ------------------------------------------------------------------ trainer side

    def _note_position(self, sample_id: str) -> None:
        ep = self._epoch
        if ep is None:
            raise RuntimeError("OnlineSource.get called before plan(epoch)")
        pos = ep.pos.get(sample_id)
        if pos is not None:
            if not ep.started:
                ep.started = True
                ep.start_pos = ep.cursor = pos
                if pos:
                    log.info("epoch %d resumes at plan position %d", ep.epoch, pos)
                if self.config.delete_consumed:
                    self._request_delete()
            ep.cursor = max(ep.cursor, pos)
        self._waiting.add(sample_id)
        self._wake_loop()

    def _wait_located(self, sample_id: str, t0: float) -> str | None:
        """Under the lock: wait until the sample is committed somewhere, or failed."""
        warned = False
        try:
            while True:
                if self._fatal is not None:
                    raise RuntimeError(f"online data source failed: {self._fatal}") from self._fatal
                ep = self._epoch
                if ep is not None and sample_id in ep.failed:
                    return None
                loc = self._ready.get(sample_id)
                if loc is None and sample_id not in self._inflight and sample_id not in self._buffered:
                    loc = self._main_has(sample_id)
                if loc is not None:
                    return loc
                if self._closed:
                    raise RuntimeError("OnlineSource is closed")
                self._cond.wait(0.5)
                if not warned and time.perf_counter() - t0 > 120:
                    warned = True
                    log.warning(
                        "still waiting for sample %r after 120 s (servers down or too slow?)", sample_id
                    )
        finally:
            self._waiting.discard(sample_id)

    def _main_has(self, sample_id: str) -> str | None:
        if self._store is None:
            return None
        with self._store_lock:
            if sample_id in self._store:
                self._ready[sample_id] = "store"
                return "store"
        return None

    def _read(self, sample_id: str, loc: str) -> Sample | None:
        try:
            if loc == "store":
                with self._store_lock:
                    sample = self._store.read(sample_id)  # type: ignore[union-attr]
                kind = "samples_from_cache"
            else:
                with self._scratch_lock:
                    if sample_id not in self._scratch:  # type: ignore[operator]
                        self._scratch.refresh()  # type: ignore[union-attr]
                    sample = self._scratch.read(sample_id)  # type: ignore[union-attr]
                kind = "samples_from_scratch"
        except (KeyError, StoreError, OSError, ValueError) as e:
            log.warning("sample %r could not be read from the %s (%s): fetching it again", sample_id, loc, e)
            with self._cond:
                if self._ready.get(sample_id) == loc:
                    del self._ready[sample_id]
                if loc == "store":
                    self._store_bad.add(sample_id)
                self._wake_loop()
            return None
        with self._lock:
            if sample_id not in self._fresh:
                setattr(self.metrics, kind, getattr(self.metrics, kind) + 1)
        return sample

    # ------------------------------------------------------------------ deletion (I/O thread)

    def _delete_consumed_shards(self, closing: bool = False) -> None:
        """Delete generated shards whose samples were all consumed (or are not in this epoch's plan).

        Samples before the position the epoch started at (a resume) count as consumed; samples
        the epoch skips count for generated shards only. ``closing`` applies it also without
        ``delete_consumed`` (temporary scratch at the end).
        """
        with self._lock:
            ep = self._epoch
            if ep is None:
                return
            done = set(ep.consumed)
            if ep.started:
                done.update(ep.ids[: ep.start_pos])
            unused = done | ep.skipped
            plan = ep.pos
        deleted: list[str] = []
        if (self.config.delete_consumed or closing) and self._scratch is not None:
            with self._scratch_lock:
                self._scratch.refresh()
                for shard, ids in self._scratch.shards().items():
                    if ids and all(i in unused or i not in plan for i in ids):
                        self._scratch.delete_shard(shard)
                        deleted.extend(ids)
                        self.metrics.shards_deleted += 1
            with self._cond:
                for i in deleted:
                    self._sizes.pop(i, None)
                    if self._ready.get(i) == "scratch":
                        del self._ready[i]
            self._update_scratch_usage()
        if self.config.delete_cached and not closing and self._store is not None:
            gone: list[str] = []
            with self._store_lock:
                self._store.refresh()
                for shard, ids in self._store.shards().items():
                    if ids and all(i in done for i in ids):
                        log.info("deleting consumed shard %s of the offline store (--delete-cached)", shard)
                        self._store.delete_shard(shard)
                        gone.extend(ids)
                        self.metrics.shards_deleted += 1
            with self._cond:
                for i in gone:
                    if self._ready.get(i) == "store":
                        del self._ready[i]
        self._wake_loop()

    def _update_scratch_usage(self) -> None:
        if self._scratch_path is None:
            return
        used = dir_bytes(self._scratch_path)
        with self._lock:
            self._scratch_overhead = max(0, used - sum(self._sizes.values()))
            self.metrics.scratch_bytes = used
            self.metrics.scratch_peak_bytes = max(self.metrics.scratch_peak_bytes, used)

    @staticmethod
    def _close_writer(writer) -> None:
        try:
            writer.close()
        except Exception as e:  # a failing flush at close loses only uncommitted (unconsumed) samples
            log.warning("closing a store writer failed: %s", e)

    # ------------------------------------------------------------------ fetch thread

    def _wake_loop(self) -> None:
        wake = self._wake
        if wake is not None and not self._loop.is_closed():
            with contextlib.suppress(RuntimeError):
                self._loop.call_soon_threadsafe(wake.set)

    def _thread_main(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self._run())
        finally:
            self._loop.close()

    async def _run(self) -> None:
        self._wake = asyncio.Event()
        self._started.set()
        tasks: set[asyncio.Task] = set()
        try:
            async with self._client_factory() as client:
                from hsgen.saturate import SaturationConfig, Saturator

                self._sat = Saturator(
                    SaturationConfig(**self.config.saturation),
                    list(client.endpoints),
                    client.metrics,
                    client.healthy,
                )
                await self._sat.start()
                self._client = client
                try:
                    await self._loop_until_closed(tasks)
                finally:  # stop the requests before the client's session closes
                    for t in tasks:
                        t.cancel()
                    if tasks:
                        await asyncio.wait(set(tasks), timeout=10)
                    await self._sat.stop()
        except Exception as e:
            log.exception("the hidden-state client failed")
            self._set_fatal(e)

    async def _loop_until_closed(self, tasks: set[asyncio.Task]) -> None:
        assert self._wake is not None
        while not self._closed:
            self._wake.clear()
            try:
                await self._step(tasks)
            except Exception as e:  # a bug or a fatal setting: surface it in get()
                log.exception("online fetch loop failed")
                self._set_fatal(e)
                return
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout=self.config.flush_interval_s)

    async def _probe_header(self) -> None:
        """Fetch the first planned samples until one succeeds, to learn hidden size and dtype of a new store."""
        if self._probe_lock is None:
            self._probe_lock = asyncio.Lock()
        async with self._probe_lock:
            if self._header is not None:
                return
            while not hasattr(self, "_client"):
                await asyncio.sleep(0.01)
            with self._lock:
                ep = self._epoch
                if ep is not None:
                    order = ep.ids[ep.cursor :]
                else:  # not planned yet: this rank's first epoch, so the probe's sample gets trained
                    order = self._plans.setdefault(0, list(self._plan_fn(self.split_ids, 0)))
            from hsgen.render import RenderError

            last: Exception | None = None
            for sid in order[:8]:
                try:
                    prompt = self._renderer.render(self._inputs[sid])
                    fetched = await self._client.fetch(prompt)
                except (RenderError, Exception) as e:  # noqa: B014 - report and try the next one
                    last = e
                    self._fail(sid, f"{type(e).__name__}: {e}")
                    continue
                hs = fetched.hidden_states
                self._header = self._make_header(int(hs.shape[2]), int(hs.shape[1]), str(fetched.dtype))
                await asyncio.get_running_loop().run_in_executor(self._io, self._open_scratch)
                await self._commit_fetched(sid, fetched)
                await self._flush()
                return
            raise RuntimeError(f"the first {len(order[:8])} samples could not be fetched; last error: {last}")

    async def _step(self, tasks: set[asyncio.Task]) -> None:
        loop = asyncio.get_running_loop()
        if self._fatal is not None:
            return
        if self._header is None:
            with self._lock:
                active = self._epoch is not None and self._epoch.started
            if active:
                await self._probe_header()
            return
        now = time.monotonic()
        if self._store is not None and now - self._last_refresh >= self.config.store_refresh_s:
            await loop.run_in_executor(self._io, self._refresh_main)
        todo = self._window_missing()
        if len(self._rendered) > 2 * self.config.prefetch_samples:
            keep = set(todo)
            for sid in [k for k in self._rendered if k not in keep]:
                del self._rendered[sid]
        need_render = [sid for sid in todo if sid not in self._rendered][:64]
        if need_render:
            await loop.run_in_executor(self._render_pool, self._render_many, need_render)
        for sid, est, overshoot in self._schedule():
            prompt = self._rendered.pop(sid)
            if overshoot:
                self.metrics.overshoots += 1
            t = asyncio.create_task(self._fetch(sid, prompt, est))
            tasks.add(t)
            t.add_done_callback(tasks.discard)
        if self._should_flush():
            await self._flush()

    def _refresh_main(self, force: bool = False) -> None:
        if self._store is None:
            if self._store_refused:
                return
            try:
                store = HiddenStateStore.open(self.config.store)
            except StoreError:
                return
            problems = self._header.compatible_with(store.header) if self._header is not None else []
            problems = [p for p in problems if not p.startswith("verifier:")]  # hub id vs local path
            if problems:
                self._store_refused = True
                log.error(
                    "%s appeared with other data than this run's (%s): not read",
                    store.path,
                    "; ".join(problems),
                )
                return
            log.info(
                "%s appeared (a concurrent hsgen generate?): its samples are read from now on", store.path
            )
            self._store = store
        with self._store_lock:
            self._store.refresh()
        self._last_refresh = time.monotonic()
        if not force:
            with self._cond:
                self._cond.notify_all()

    def _window_missing(self) -> list[str]:
        """Ids in the prefetch window that are neither committed, in flight nor failed."""
        with self._lock:
            ep = self._epoch
            if ep is None or not ep.started:
                return []
            out = []
            waiting = [w for w in self._waiting if w not in ep.pos]
            end = min(len(ep.ids), ep.cursor + self.config.prefetch_samples)
            for sid in waiting + ep.ids[ep.cursor : end]:
                if self._is_missing(sid, ep):
                    out.append(sid)
            return out

    def _is_missing(self, sid: str, ep: _Epoch) -> bool:
        if sid in self._ready or sid in self._inflight or sid in self._buffered or sid in ep.failed:
            return False
        if sid in ep.consumed or sid in ep.skipped:
            return False
        if self._store is not None and sid not in self._store_bad:
            with self._store_lock:
                if sid in self._store:
                    self._ready[sid] = "store"
                    return False
        if sid in self._sizes:
            self._ready[sid] = "scratch"
            return False
        return True

    def _render_many(self, ids: list[str]) -> None:
        from hsgen.render import RenderError

        for sid in ids:
            try:
                self._rendered[sid] = self._renderer.render(self._inputs[sid])
            except RenderError as e:
                self._fail(sid, f"render: {e}")

    def _in_use(self) -> int:
        """Scratch bytes the bound applies to (caller holds the lock)."""
        pending = sum(self._inflight.values()) + sum(self._buffered.values())
        if self.config.cache_generated:
            return pending
        if self.config.delete_consumed:
            return pending + sum(self._sizes.values()) + self._scratch_overhead
        ep = self._epoch
        if ep is None:
            return pending
        ahead = sum(b for i, b in self._sizes.items() if ep.pos.get(i, -1) >= ep.cursor)
        return pending + ahead

    def _schedule(self) -> list[tuple[str, int, bool]]:
        """Pick the next samples to request, in plan order, within the window and the byte bound."""
        out: list[tuple[str, int, bool]] = []
        with self._lock:
            ep = self._epoch
            if ep is None or not ep.started:
                return out
            in_use = self._in_use()
            end = min(len(ep.ids), ep.cursor + self.config.prefetch_samples)
            waiting = [w for w in self._waiting if w not in ep.pos]
            for sid in waiting + ep.ids[ep.cursor : end]:
                if len(self._inflight) >= self.config.max_in_flight:
                    break
                if sid not in self._rendered or not self._is_missing(sid, ep):
                    continue
                est = self._bytes_for(len(self._rendered[sid].token_ids))
                over = in_use + est > self.config.scratch_bytes
                if over and self.config.cache_generated:
                    over = False
                if over and not self._stalled(sid):
                    break
                self._inflight[sid] = est
                in_use += est
                out.append((sid, est, over))
        return out

    def _stalled(self, sid: str) -> bool:
        """Whether only a fetch past the bound can unblock the trainer (caller holds the lock).

        True when ``get(sid)`` waits, nothing is in flight or buffered, and no step completed for
        well over the usual step interval: the bound is smaller than the trainer's working set
        (its read-ahead plus one step), so refusing would deadlock.
        """
        if sid not in self._waiting or self._inflight or self._buffered:
            return False
        idle = time.monotonic() - self._last_consumed
        if idle < max(5.0, 5 * self._step_interval):
            return False
        if not self._warned_bound:
            self._warned_bound = True
            log.warning(
                "scratch bound %d bytes is smaller than the trainer's working set (read-ahead + one step): "
                "fetching past it to avoid a deadlock; raise --scratch-bytes",
                self.config.scratch_bytes,
            )
        return True

    async def _fetch(self, sid: str, prompt, est: int) -> None:
        url = await self._sat.acquire()
        t0 = time.monotonic()
        ok = False
        try:
            fetched = await self._client.fetch(prompt, endpoint=url)
            ok = True
        except asyncio.CancelledError:
            raise
        except Exception as e:
            from hsgen.client import FatalError

            with self._cond:  # one critical section (the lock is re-entrant): no refetch in between
                self._inflight.pop(sid, None)
                if isinstance(e, FatalError):  # no other prompt can succeed either (API key, server setup)
                    self._set_fatal(e)
                    return
            self._fail(sid, f"{type(e).__name__}: {e}")
            return
        finally:
            await self._sat.release(url, latency_s=time.monotonic() - t0, tokens=len(prompt.token_ids), ok=ok)
        try:
            await self._commit_fetched(sid, fetched)
        except Exception as e:
            with self._cond:
                self._inflight.pop(sid, None)
                self._buffered.pop(sid, None)
            if isinstance(e, _HeaderProblem):
                self._set_fatal(e)
                return
            self._fail(sid, f"store: {type(e).__name__}: {e}")
            return
        if sid in self._waiting:
            self._wake.set()  # type: ignore[union-attr]

    async def _commit_fetched(self, sid: str, fetched) -> None:
        h = self._header
        assert h is not None
        hs = fetched.hidden_states
        if (
            hs.ndim != 3
            or hs.shape[1] != h.num_layers
            or hs.shape[2] != h.hidden_size
            or fetched.dtype != h.dtype
        ):
            raise _HeaderProblem(
                f"the server returned hidden states {tuple(hs.shape)} {fetched.dtype} for {sid!r}, but the store "
                f"holds [T, {h.num_layers}, {h.hidden_size}] {h.dtype} (layers {list(h.layer_ids)}): the servers "
                "run other extraction settings than the store was built with"
            )
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(self._io, self._add, sid, fetched, self._bytes_for(int(hs.shape[0])))

    def _add(self, sid: str, fetched, size: int) -> None:
        """Buffer one fetched sample in the writer (I/O thread); commit a shard once the buffer is full."""
        writer = self._main_writer if self.config.cache_generated else self._scratch_writer
        landed = False
        if self.config.cache_generated:
            with self._store_lock:
                self._store.refresh()  # type: ignore[union-attr]
                landed = sid in self._store  # a concurrent hsgen generate landed it meanwhile
        if not landed:
            lock = self._store_lock if self.config.cache_generated else self._scratch_lock
            with lock:
                writer.add(sid, fetched.hidden_states, fetched.token_ids, fetched.loss_mask)
        with self._cond:
            self._inflight.pop(sid, None)
            self._buffered[sid] = size
            if self._buffered_since is None:
                self._buffered_since = time.monotonic()
            full = sum(self._buffered.values()) >= self._scratch_shard_bytes
        # Commit here, in the same I/O job: many fetches finishing together queue their adds
        # ahead of any flush job, which would then seal them all as one oversized shard.
        if full:
            try:
                self._flush_sync()
            except Exception as e:  # as a failing flush in the fetch loop: the store is unusable
                log.exception("committing a scratch shard failed")
                self._set_fatal(e)

    def _should_flush(self) -> bool:
        with self._lock:
            if not self._buffered:
                return False
            if any(w in self._buffered for w in self._waiting):
                return True
            if sum(self._buffered.values()) >= self._scratch_shard_bytes:
                return True
            if not self._inflight:
                return True
            return (
                self._buffered_since is not None
                and time.monotonic() - self._buffered_since >= self.config.flush_interval_s
            )

    async def _flush(self) -> None:
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(self._io, self._flush_sync)

    def _flush_sync(self) -> None:
        cache = self.config.cache_generated
        writer = self._main_writer if cache else self._scratch_writer
        lock = self._store_lock if cache else self._scratch_lock
        with self._lock:
            ids = list(self._buffered)
        if not ids:
            return
        with lock:
            records = writer.flush()
            (self._store if cache else self._scratch).refresh()  # type: ignore[union-attr]
        with self._cond:
            for sid in ids:
                size = self._buffered.pop(sid, 0)
                self._ready[sid] = "store" if cache else "scratch"
                self._fresh.add(sid)
                if not cache:
                    self._sizes[sid] = size
            self.metrics.samples_generated += len(records)
            self._buffered_since = None
            self._cond.notify_all()
        if not cache:
            self._update_scratch_usage()

    def _set_fatal(self, error: BaseException) -> None:
        """Stop the run: every waiting and later ``get`` raises ``error`` (no retry can fix it)."""
        with self._cond:
            self._fatal = error
            self._cond.notify_all()

    def _fail(self, sid: str, reason: str) -> None:
        with self._cond:
            ep = self._epoch
            epoch = ep.epoch if ep is not None else -1
            if ep is not None:
                ep.failed[sid] = reason
            self.metrics.samples_failed += 1
            source = getattr(self._inputs.get(sid), "source", "")
            log.warning("sample %r (%s) cannot be produced and is skipped: %s", sid, source, reason)
            if self._failures_file is None:
                path = self._failures_path()
                path.parent.mkdir(parents=True, exist_ok=True)
                self._failures_file = open(path, "a", encoding="utf-8")  # noqa: SIM115
            rec = {"sample_id": sid, "source": source, "epoch": epoch, "reason": reason, "time": time.time()}
            self._failures_file.write(json.dumps(rec) + "\n")
            self._failures_file.flush()
            self._cond.notify_all()

    def _failures_path(self) -> Path:
        if self.config.failures_path:
            return Path(self.config.failures_path)
        base = Path(self.config.save_path) if self.config.save_path else Path.cwd()
        suffix = "" if self.config.split == "train" else f"-{self.config.split}"
        return base / f"online-failures{suffix}-rank{self.config.rank}.jsonl"

    @property
    def failures_path(self) -> Path:
        """The JSONL file listing samples that could not be produced."""
        return self._failures_path()


class _HeaderProblem(ValueError):
    """Fetched hidden states that do not match the store header (fatal: a configuration error)."""
