"""The stores of an online run: the user's store (read; it may appear or grow while the run goes)
and the scratch store that generated samples are committed to, with their writers and locks."""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path

from hsgen.store import HiddenStateStore, StoreError, StoreHeader
from spectrain.online.config import OnlineConfig
from spectrain.online.scratch import PER_SAMPLE_OVERHEAD, choose_scratch_dir, open_scratch_store

log = logging.getLogger(__name__)


class OnlineStores:
    """The user's store and the scratch store (see the module docstring).

    ``store`` is None until the user's store exists (``cache_generated`` creates it); ``header``
    is None until the store or the first fetched sample says what the states are. Reads and
    writes of each store hold its lock (``store_lock``, ``scratch_lock``).
    """

    def __init__(self, config: OnlineConfig, fingerprint: str):
        self.config = config
        self.fingerprint = fingerprint
        self.store_lock = threading.RLock()
        self.scratch_lock = threading.RLock()
        self.store: HiddenStateStore | None = None
        self.refused = False  # the store appeared with other data than this run's
        path = Path(config.store)
        try:
            self.store = HiddenStateStore.open(path)
        except StoreError:
            if path.exists() and any(path.iterdir()):
                raise
            log.info("%s is not a store yet: every sample will be fetched online", path)
        self.header: StoreHeader | None = self.store.header if self.store is not None else None
        self._check_fingerprint()
        self.scratch: HiddenStateStore | None = None
        self.scratch_path: Path | None = None
        self.scratch_writer = None
        self.main_writer = None
        self.last_refresh = 0.0

    def _check_fingerprint(self) -> None:
        have = self.header.tokenizer_fingerprint if self.header else ""
        mine = self.fingerprint
        if have and mine and have != mine:
            raise StoreError(
                f"{self.config.store}: its tokenizer fingerprint {have[:12]}... differs from the verifier's "
                f"tokenizer + chat template at {self.config.verifier} ({mine[:12]}...): the prompts would "
                "render to other token ids than the stored ones"
            )

    def make_header(self, hidden_size: int, num_layers: int, dtype: str) -> StoreHeader:
        """The scratch store's header for what the servers returned (a run with no store yet)."""
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
        return StoreHeader(verifier=self.config.verifier, layer_ids=tuple(sorted(ids)), hidden_size=hidden_size,
                           dtype=dtype, tokenizer_fingerprint=self.fingerprint)  # fmt: skip

    def bytes_for(self, tokens: int) -> int:
        """Bytes a sample of ``tokens`` tokens holds in a store (what the scratch bound counts)."""
        h = self.header
        assert h is not None
        item = 4 if h.dtype == "float32" else 2
        return tokens * (h.num_layers * h.hidden_size * item + 9) + PER_SAMPLE_OVERHEAD

    def open_scratch(self, need_bytes: int, need_what: str = "the scratch needs") -> dict[str, int]:
        """Open (or create) the scratch store, and the writers; returns the bytes of each sample
        an earlier run left there (they are read, not fetched again). ``need_bytes`` (what
        ``need_what`` says it is) decides between tmpfs and the save path."""
        assert self.header is not None
        cfg = self.config
        if cfg.scratch_dir:
            # one store per rank: a rank deletes shards holding none of its planned samples
            path = Path(cfg.scratch_dir)
            if cfg.world_size > 1:
                path = path / f"rank{cfg.rank}"
        else:
            path = choose_scratch_dir(
                cfg.save_path, cfg.rank, need_bytes, split=cfg.split, needed_what=need_what
            )
        scratch = open_scratch_store(path, self.header)
        # the training and validation sources of one process write at once: each its own writer id
        split = "" if cfg.split == "train" else f"{cfg.split}-"
        writer_id = f"online-{split}rank{cfg.rank}-{os.getpid()}"
        self.scratch = scratch
        self.scratch_path = path
        # no fsync: a scratch store is throwaway, a killed process's writes survive without it, and a
        # sample torn by a power loss fails its checksum when a later run reads it
        self.scratch_writer = scratch.writer(writer_id, shard_bytes=1 << 62, fsync=False)
        sizes = {sid: self.bytes_for(scratch.record(sid).length) for sid in scratch.sample_ids()}
        if sizes:
            log.info(
                "scratch %s holds %d samples from an earlier run: they are read, not fetched",
                path,
                len(sizes),
            )
        log.info("online scratch store: %s (bound %.2f GB)", path, cfg.scratch_bytes / 1e9)
        if cfg.cache_generated:
            if self.store is None:
                self.store = HiddenStateStore.create(Path(cfg.store), self.header, exist_ok=True)
            self.main_writer = self.store.writer(writer_id, shard_bytes=1 << 62)
        return sizes

    def refresh_main(self) -> bool:
        """Re-read the user's store (open it if it appeared meanwhile); False when there is none to read."""
        if self.store is None:
            if self.refused:
                return False
            try:
                store = HiddenStateStore.open(self.config.store)
            except StoreError:
                return False
            problems = self.header.compatible_with(store.header) if self.header is not None else []
            problems = [p for p in problems if not p.startswith("verifier:")]  # hub id vs local path
            if problems:
                self.refused = True
                log.error("%s appeared with other data than this run's (%s): not read", store.path,
                          "; ".join(problems))  # fmt: skip
                return False
            log.info(
                "%s appeared (a concurrent hsgen generate?): its samples are read from now on", store.path
            )
            self.store = store
        with self.store_lock:
            self.store.refresh()
        self.last_refresh = time.monotonic()
        return True

    def in_main(self, sample_id: str) -> bool:
        """Whether the user's store holds the sample now."""
        if self.store is None:
            return False
        with self.store_lock:
            return sample_id in self.store

    def main_length(self, sample_id: str) -> int | None:
        """The stored token count of a sample of the user's store (None if it is not there)."""
        with self.store_lock:
            if self.store is not None and sample_id in self.store:
                return self.store.record(sample_id).length
        return None
