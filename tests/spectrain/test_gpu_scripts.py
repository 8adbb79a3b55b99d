"""The GPU side-by-side scripts: shell syntax, and the whole run at a tiny shape on CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
GPU = ROOT / "scripts" / "gpu"


@pytest.mark.parametrize("script", sorted(p.name for p in GPU.glob("*.sh")))
def test_shell_syntax(script):
    subprocess.run(["bash", "-n", str(GPU / script)], check=True)


def test_summarize_reads_every_part(tmp_path):
    logs = tmp_path / "logs"
    (logs / "peer").mkdir(parents=True)
    (logs / "ours.json").write_text("progress\n" + json.dumps(
        {"device": "H200", "dflash_tokens_per_s": 60000.0, "dflash_peak_gib": 27.0, "dflash_sync_free": True,
         "eagle3_tokens_per_s": 90000.0, "eagle3_peak_gib": 15.0}) + "\n")  # fmt: skip
    (logs / "ours-compiled.json").write_text(json.dumps(
        {"device": "H200", "dflash_tokens_per_s_compiled": 66000.0, "dflash_first_step_s_compiled": 61.5,
         "dflash_sync_free": False}) + "\n")  # fmt: skip
    (logs / "peer" / "results.jsonl").write_text(
        json.dumps({"model": "dflash", "ok": True, "tokens_per_s": 45847, "peak_mem_alloc_gib": 36.8}) + "\n"
        + json.dumps({"model": "eagle3", "ok": False, "error": "OOM"}) + "\n")  # fmt: skip
    steps = [
        {"split": "train", "step": i, "tokens_per_s": t, "data_wait_fraction": w}
        for i, (t, w) in enumerate([(1.0, 0.9), (2.0, 0.8), (50000.0, 0.1), (52000.0, 0.2), (51000.0, 0.3)])
    ]
    (logs / "train-metrics.jsonl").write_text("".join(json.dumps(s) + "\n" for s in steps))
    (logs / "online.json").write_text(json.dumps({"online_gbps": 9.1, "online_ratio": 0.85, "online_raw_gbps": 10.7,
                                                  "real_wait_fraction": 0.01, "other": 1}) + "\n")  # fmt: skip
    out = subprocess.run([sys.executable, str(GPU / "summarize.py"), str(tmp_path)], capture_output=True, text=True,
                         check=True)  # fmt: skip
    s = json.loads(out.stdout)
    assert s["dflash_speed_ratio"] == round(60000 / 45847, 3)
    assert s["dflash_memory_ratio"] == round(27.0 / 36.8, 3)
    assert s["eagle3_speed_ratio"] is None and s["peer"]["eagle3"]["error"] == "OOM"
    assert s["dflash_compile_speedup"] == 1.1 and s["dflash_compile_s"] == 61.5
    assert s["dflash_compiled_speed_ratio"] == round(66000 / 45847, 3)
    assert s["dflash_sync_free"] is True and s["dflash_sync_free_compiled"] is False
    assert s["eagle3_compile_speedup"] is None
    assert s["train"] == {"steps": 5, "tokens_per_s_median": 51000.0, "data_wait_fraction_median": 0.2}
    assert s["serve"] is None
    assert s["data_path"] == {"loader_gbps": None, "loader_ratio": None, "raw_gbps": None, "online_gbps": 9.1,
                              "online_ratio": 0.85, "online_raw_gbps": 10.7, "real_wait_fraction": 0.01}  # fmt: skip


@pytest.mark.slow
def test_run_all_at_a_tiny_shape_on_cpu(tmp_path):
    """run_all.sh end to end on CPU (peer skipped: no carry folder): every part reports."""
    env = {
        **os.environ,
        "TINY": "1",
        "DEVICE": "cpu",
        "PYTHON": "python",
        "OUT": str(tmp_path / "out"),
        "WORK": str(tmp_path / "work"),
        "CARRY": str(tmp_path / "no-carry"),
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join(
            str(ROOT / p) for p in ("packages/hsgen/src", "packages/spectrain/src")
        ),
    }
    subprocess.run(["bash", str(GPU / "run_all.sh")], env=env, check=True, timeout=400, capture_output=True)
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "logs.tar.gz",
        "run_all.log",
        "summary.json",
    ]
    s = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert s["dflash_tokens_per_s"] > 0 and s["eagle3_tokens_per_s"] > 0
    assert s["ours"]["dflash_syncs"] == {} and s["ours"]["eagle3_syncs"] == {}  # the sync census ran: none
    assert s["dflash_sync_free"] is True and s["eagle3_sync_free_compiled"] is True
    assert s["dflash_tokens_per_s_compiled"] > 0 and s["eagle3_compile_speedup"] > 0
    assert s["peer_dflash_tokens_per_s"] is None
    assert s["train"]["steps"] == 4 and s["train"]["tokens_per_s_median"] > 0
    assert s["serve"]["verify"]["ok"] and s["serve"]["generate"]["stored"] == 8
    assert set(s["data_path"].values()) == {None}  # part 5 is skipped at the tiny shape


def test_run_all_stops_at_once_when_an_import_fails(tmp_path):
    """A missing wheel on the GPU image ends the run in seconds (device time left for a rerun)."""
    python = tmp_path / "python-without-site"
    python.write_text(f'#!/bin/sh\nexec "{sys.executable}" -S "$@"\n')  # no site-packages: no click, no zarr
    python.chmod(0o755)
    env = {**os.environ, "TINY": "1", "DEVICE": "cpu", "PYTHON": str(python), "OUT": str(tmp_path / "out"),
           "WORK": str(tmp_path / "work"), "CARRY": str(tmp_path / "no-carry")}  # fmt: skip
    r = subprocess.run(["bash", str(GPU / "run_all.sh")], env=env, timeout=60, capture_output=True, text=True)
    assert r.returncode == 3
    log = (tmp_path / "out" / "run_all.log").read_text()
    assert "imports failed, stopping: ModuleNotFoundError" in log and "1/5" not in log
    assert json.loads((tmp_path / "out" / "summary.json").read_text())["ours"] is None


def test_run_all_reruns_only_the_parts_asked_for(tmp_path):
    env = {**os.environ, "TINY": "1", "DEVICE": "cpu", "PYTHON": sys.executable, "PARTS": "serve",
           "OUT": str(tmp_path / "out"), "WORK": str(tmp_path / "work"), "CARRY": str(tmp_path / "no-carry"),
           "PYTHONPATH": os.pathsep.join(str(ROOT / p) for p in ("packages/hsgen/src", "packages/spectrain/src"))}  # fmt: skip
    subprocess.run(["bash", str(GPU / "run_all.sh")], env=env, check=True, timeout=120, capture_output=True)
    log = (tmp_path / "out" / "run_all.log").read_text()
    assert "4/5" in log and not any(f"{k}/5" in log for k in (1, 2, 3, 5))
    s = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert s["serve"]["verify"]["ok"] and s["ours"] is None and s["train"]["steps"] == 0
