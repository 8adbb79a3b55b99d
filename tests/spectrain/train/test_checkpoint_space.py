"""A checkpoint that does not fit (issue 21, hole 7).

Before: a full disk during ``torch.save`` ended the run in a 49-line double traceback ending in a
torch internal error, no path. Now: one line naming the checkpoint's path and the space it
needs, the half-written directory removed, the previous checkpoint and ``latest`` untouched,
exit non-zero. The failure is real: the second run writes under ``RLIMIT_FSIZE`` (a per-file size
limit any user may lower; the kernel fails the write with EFBIG, as a full disk fails it with
ENOSPC), and the space pre-check meets a state larger than the real free space.
"""

from __future__ import annotations

import hashlib
import resource
import shutil
import signal
import subprocess
import sys

import pytest
import torch

from spectrain.train.checkpoint import LATEST, CheckpointWriteError, write_checkpoint


def _digest(path) -> dict[str, str]:
    return {
        str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in path.rglob("*")
        if p.is_file()
    }


@pytest.mark.timeout(1200)
def test_a_save_that_runs_out_of_room_leaves_the_previous_checkpoint_and_says_so(
    tiny_store, tiny_model_dir, tmp_path
):
    save = tmp_path / "run"
    base = [sys.executable, "-m", "spectrain.cli", "train", "--store", str(tiny_store), "--verifier",
            str(tiny_model_dir), "--block-size", "4", "--num-layers", "1", "--max-anchors", "16",
            "--total-seq-len", "256", "--val-fraction", "0", "--device", "cpu", "--save-path", str(save)]  # fmt: skip
    first = subprocess.run([*base, "--epochs", "1"], capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, first.stderr[-2000:]
    latest = (save / LATEST).read_text()
    before = save / latest.strip()
    kept = _digest(before)
    big = min((before / "model.safetensors").stat().st_size, (before / "trainer" / "state.pt").stat().st_size)
    limit = big // 2
    assert limit > 8 * (save / "metrics.jsonl").stat().st_size  # only the checkpoint's big files hit it

    def small_files() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write fails with EFBIG instead of a signal
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    second = subprocess.run(
        [*base, "--epochs", "2"], capture_output=True, text=True, timeout=600, preexec_fn=small_files
    )
    assert second.returncode not in (0, -signal.SIGXFSZ), second.stderr[-3000:]
    assert "Traceback" not in second.stderr, second.stderr[-3000:]
    last = second.stderr.strip().splitlines()[-1]
    assert "cannot save the checkpoint (File too large)" in last and "MiB free in" in last, last
    assert str(save / "checkpoint-") in last and str(before) not in last, last
    assert (save / LATEST).read_text() == latest
    assert _digest(before) == kept
    assert sorted(p.name for p in save.iterdir()) == sorted([before.name, LATEST, "metrics.jsonl", *(
        p.name for p in save.iterdir() if p.name in ("report", "tensorboard", "run.json"))])  # fmt: skip
    assert not list(save.glob(".tmp-*")) and not (save / (LATEST + ".tmp")).exists()


def test_a_checkpoint_larger_than_the_free_space_is_refused_before_a_byte_is_written(tmp_path):
    free = shutil.disk_usage(tmp_path).free
    state = {"model": {"w": torch.empty(free // 4 + 1, device="meta")}, "loop": {"global_step": 7}}
    (tmp_path / LATEST).write_text("checkpoint-00000003\n")

    def export(_):
        raise AssertionError("nothing may be written")

    with pytest.raises(CheckpointWriteError, match="not enough free space") as ei:
        write_checkpoint(tmp_path, "checkpoint-00000007", state, {}, export)
    assert str(tmp_path / "checkpoint-00000007") in str(ei.value) and "\n" not in str(ei.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == [LATEST]
    assert (tmp_path / LATEST).read_text() == "checkpoint-00000003\n"


def test_another_write_error_is_not_dressed_as_a_full_disk(tmp_path):
    def export(_):
        raise ValueError("a bug")

    with pytest.raises(ValueError, match="a bug"):
        write_checkpoint(tmp_path, "checkpoint-00000001", {"model": {}}, {}, export)
    assert list(tmp_path.iterdir()) == []
