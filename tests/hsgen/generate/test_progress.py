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
                           stderr=f, stdout=subprocess.PIPE, text=True, timeout=600)  # fmt: skip
    err = log.read_text()
    assert r.returncode == 0, err
    assert "\r" not in err and "verify: 15/15 tok (100%)" in err
    with log.open("w") as f:
        subprocess.run([sys.executable, "-m", "hsgen.cli", "verify", str(tmp_path / "s"), "--no-progress"],
                       stderr=f, stdout=subprocess.PIPE, timeout=600)  # fmt: skip
    assert "verify:" not in log.read_text()


def test_count_records_of_the_inputs(tmp_path):
    from hsgen.inputs.count import count_records

    (tmp_path / "a.jsonl").write_text('{"x": 1}\n\n{"x": 2}\n{"x": 3}')  # a blank line, no final newline
    (tmp_path / "b.jsonl").write_text('{"x": 4}\n')
    assert count_records([tmp_path / "a.jsonl", str(tmp_path / "b.jsonl")]) == 4
    assert count_records([tmp_path / "a.jsonl", "-"]) is None  # stdin: no total
    assert count_records([tmp_path / "missing.jsonl"]) is None


async def test_generate_bar_counts_the_input_to_its_total(tmp_path, caplog, monkeypatch):
    """The bar's total is the input's records (stored-already ones count as they are read), or
    --max-samples; the log line then shows n/total and an ETA."""
    import asyncio

    from fake_vllm import FakeConfig, FakeVLLM
    from test_generate import gen_cfg, make_store, prompts

    from hsgen.generate.pipeline import generate

    monkeypatch.setattr(sys.stderr, "isatty", lambda: False, raising=False)
    progress.configure(None)  # log lines
    shared, store, ps = tmp_path / "shm", make_store(tmp_path / "store"), prompts(10)
    loop = asyncio.get_running_loop()
    counted = asyncio.Event()

    def count():
        loop.call_soon_threadsafe(counted.set)
        return len(ps)

    async def stream():
        await counted.wait()  # the total lands before the first sample can
        for p in ps:
            yield p

    async with FakeVLLM(FakeConfig(str(shared))) as url:
        await generate(gen_cfg(url, shared), ps[:4], store, progress=False)
        with caplog.at_level(logging.INFO, logger="hsgen.progress"):
            s = await generate(gen_cfg(url, shared), stream(), store, count=count)
            assert (s.already_done, s.stored) == (4, 6)
            last = [r.getMessage() for r in caplog.records][-1]
            assert last.startswith("generate: 10/10 prompt (100%)") and "ETA 00:00" in last, last
            caplog.clear()
            s = await generate(gen_cfg(url, shared, max_samples=2), prompts(5, start=20), store, count=count)
            assert s.stored == 2
            last = [r.getMessage() for r in caplog.records][-1]
            assert last.startswith("generate: 2/2 prompt (100%)"), last
