"""The two JSONL records an online run keeps beside its checkpoints: failures and consumed steps."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO

from spectrain.online.config import OnlineConfig


class FailureLog:
    """``online-failures[-<split>]-rank<r>.jsonl``: one line per sample that could not be produced."""

    def __init__(self, config: OnlineConfig):
        self.config = config
        self._file: IO[str] | None = None
        self._lock = threading.Lock()

    @property
    def path(self) -> Path:
        if self.config.failures_path:
            return Path(self.config.failures_path)
        base = Path(self.config.save_path) if self.config.save_path else Path.cwd()
        suffix = "" if self.config.split == "train" else f"-{self.config.split}"
        return base / f"online-failures{suffix}-rank{self.config.rank}.jsonl"

    def write(self, sample_id: str, source: str, epoch: int, reason: str) -> None:
        rec = {
            "sample_id": sample_id,
            "source": source,
            "epoch": epoch,
            "reason": reason,
            "time": time.time(),
        }
        with self._lock:
            if self._file is None:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115
            self._file.write(json.dumps(rec) + "\n")
            self._file.flush()

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None


class ConsumedLog:
    """``online-consumed-rank<r>.jsonl``: the sample ids of each completed optimizer step (an audit:
    after a kill and resume, every planned sample appears once per epoch in the steps that count)."""

    def __init__(self, config: OnlineConfig, run_id: str):
        self.config = config
        self.run_id = run_id
        self._file: IO[str] | None = None

    def write(self, epoch: int, start_pos: int, positions: Sequence[int], ids: Sequence[str]) -> None:
        if self.config.save_path is None or self.config.split != "train":
            return
        if self._file is None:
            path = Path(self.config.save_path) / f"online-consumed-rank{self.config.rank}.jsonl"
            path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(path, "a", encoding="utf-8")  # noqa: SIM115
        rec = {"run": self.run_id, "epoch": epoch, "start_pos": start_pos, "positions": list(positions),
               "ids": list(ids)}  # fmt: skip
        self._file.write(json.dumps(rec) + "\n")
        self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
