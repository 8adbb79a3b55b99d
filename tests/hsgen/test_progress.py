"""Progress: a bar on a terminal, periodic log lines (no carriage returns) in a log file."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import numpy as np

from hsgen import progress
from hsgen.progress import LogProgress, progress_bar


def test_mode_follows_the_flag_and_the_terminal(monkeypatch):
    monkeypatch.setattr(sys.stderr, "isatty", lambda: False, raising=False)
    progress.configure(None)
    assert progress.mode() == "log" and isinstance(progress_bar(total=3), LogProgress)
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True, raising=False)
    assert progress.mode() == "bar" and not isinstance(progress_bar(total=3), LogProgress)
    progress.configure(False)
    assert progress.mode() == "off" and progress_bar(total=3).disable
    progress.configure(True)
    monkeypatch.setattr(sys.stderr, "isatty", lambda: False, raising=False)
    assert progress.mode() == "bar"
    monkeypatch.delenv("HF_HUB_DISABLE_PROGRESS_BARS", raising=False)
    progress.configure(None)  # a log file: the Hugging Face libraries' bars go too
    assert os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] == "1"


def test_log_progress_lines_with_total_rate_and_eta(caplog, monkeypatch):
    now = [0.0]
    monkeypatch.setattr(progress.time, "monotonic", lambda: now[0])
    with caplog.at_level(logging.INFO, logger="hsgen.progress"):
        bar = LogProgress(total=10, desc="train", unit="step", interval_s=25)
        for _ in range(4):
            now[0] += 10
            bar.update(1)  # t = 10, 20, 30 (logs: 25 s since the start), 40
        bar.set_postfix(loss="1.5")
        now[0] = 50
        bar.close()
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0] == "train: 3/10 step (30%), 0.1 step/s, elapsed 00:30, ETA 01:10"
    assert lines[-1] == "train: 4/10 step (40%), 0.08 step/s, elapsed 00:50, ETA 01:15, loss=1.5"
    assert len(lines) == 2


def test_iterating_reports_at_the_end(caplog):
    with caplog.at_level(logging.INFO, logger="hsgen.progress"):
        assert list(LogProgress(range(5), desc="eval", unit="prompt")) == [0, 1, 2, 3, 4]
    assert caplog.records[-1].getMessage().startswith("eval: 5/5 prompt (100%)")


def test_verify_into_a_log_file_writes_lines_not_carriage_returns(tmp_path):
    from hsgen.store import HiddenStateStore, StoreHeader

    st = HiddenStateStore.create(
        tmp_path / "s", StoreHeader(verifier="v", layer_ids=(1,), hidden_size=4, dtype="float32")
    )
    with st.writer("w") as w:
        for i in range(3):
            w.add(f"x{i}", np.ones((5, 1, 4), np.float32), np.arange(5))
    log = tmp_path / "log.txt"
    with log.open("w") as f:
        r = subprocess.run([sys.executable, "-m", "hsgen.cli", "verify", str(tmp_path / "s"), "--log-level", "INFO"],
                           stderr=f, stdout=subprocess.PIPE, text=True, timeout=60)  # fmt: skip
    err = log.read_text()
    assert r.returncode == 0, err
    assert "\r" not in err and "verify: 15/15 tok (100%)" in err
    with log.open("w") as f:
        subprocess.run([sys.executable, "-m", "hsgen.cli", "verify", str(tmp_path / "s"), "--no-progress"],
                       stderr=f, stdout=subprocess.PIPE, timeout=60)  # fmt: skip
    assert "verify:" not in log.read_text()
