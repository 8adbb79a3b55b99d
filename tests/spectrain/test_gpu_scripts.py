"""The GPU side-by-side scripts: shell syntax, the summary, the run's deadline and what a kill
leaves, and the whole run at a tiny shape on CPU."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
GPU = ROOT / "scripts" / "gpu"
SRC = os.pathsep.join(str(ROOT / p) for p in ("packages/hsgen/src", "packages/spectrain/src"))


LOOSE = {"DEADLINE": "1500", "OURS_TIMEOUT": "400", "OURS_COMPILED_TIMEOUT": "400", "TRAIN_TIMEOUT": "300",
         "SERVE_TIMEOUT": "300", "SMOKE_HEALTH_TIMEOUT": "200"}  # fmt: skip
"""Bounds for tests that are not about bounds: a loaded 2-core machine runs every part slowly."""


def _env(tmp_path: Path, **kw) -> dict:
    return {**os.environ, "TINY": "1", "DEVICE": "cpu", "PYTHON": sys.executable, "OUT": str(tmp_path / "out"),
            "WORK": str(tmp_path / "work"), "CARRY": str(tmp_path / "no-carry"), "OMP_NUM_THREADS": "1",
            "PYTHONPATH": SRC, **kw}  # fmt: skip


def _hanging_python(tmp_path: Path, pattern: str) -> str:
    """A python whose runs with ``pattern`` in their arguments never end (a part that hangs)."""
    path = tmp_path / "python-that-hangs"
    path.write_text(
        f'#!/bin/sh\ncase " $* " in *"{pattern}"*) exec sleep 600;; esac\nexec "{sys.executable}" "$@"\n'
    )
    path.chmod(0o755)
    return str(path)


def _parts(out: Path) -> dict:
    return {r["part"]: r for r in map(json.loads, (out / "parts.jsonl").read_text().splitlines())}


def _left_behind(work: Path) -> list[str]:
    """Processes still running with ``work`` on their command line."""
    found = []
    for d in Path("/proc").iterdir():
        try:
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if str(work) in cmd:
            found.append(cmd)
    return found


@pytest.mark.parametrize("script", sorted(p.name for p in GPU.glob("*.sh")))
def test_shell_syntax(script):
    subprocess.run(["bash", "-n", str(GPU / script)], check=True)


def test_summarize_reads_every_part(tmp_path):
    logs = tmp_path / "logs"
    (logs / "peer").mkdir(parents=True)
    # the last line was cut by a kill: the one before it counts
    (logs / "ours-dflash.json").write_text("progress\n" + json.dumps(
        {"device": "H200", "dflash_tokens_per_s": 60000.0, "dflash_peak_gib": 27.0, "dflash_sync_free": True,
         "parts_done": ["dflash_adamw"]}) + "\n" + '{"device": "H200", "dflash_tok')  # fmt: skip
    (logs / "ours-eagle3.json").write_text(json.dumps(
        {"device": "H200", "eagle3_tokens_per_s": 90000.0, "eagle3_peak_gib": 15.0, "parts_done": ["eagle3_adamw"]})
        + "\n")  # fmt: skip
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
    assert s["ours"]["parts_done"] == ["dflash_adamw", "eagle3_adamw"] and s["eagle3_tokens_per_s"] == 90000.0
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
@pytest.mark.timeout(1700)  # ~1-2 minutes on an idle 2-core machine; a loaded one takes many times that
def test_run_all_at_a_tiny_shape_on_cpu(tmp_path):
    """run_all.sh end to end on CPU (peer skipped: no carry folder): every part reports."""
    env = _env(tmp_path, **LOOSE)
    subprocess.run(["bash", str(GPU / "run_all.sh")], env=env, check=True, timeout=1600, capture_output=True)
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "logs.tar.gz",
        "parts.jsonl",
        "run_all.log",
        "summary.json",
    ]
    s = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert s["dflash_tokens_per_s"] > 0 and s["eagle3_tokens_per_s"] > 0 and s["dspark_tokens_per_s"] > 0
    assert s["ours"]["dflash_syncs"] == {} and s["ours"]["eagle3_syncs"] == {}  # the sync census ran: none
    assert s["ours"]["dspark_syncs"] == {} and s["dspark_tokens_per_s_compiled"] > 0
    assert s["dflash_sync_free"] is True and s["eagle3_sync_free_compiled"] is True
    assert s["dflash_tokens_per_s_compiled"] > 0 and s["eagle3_compile_speedup"] > 0
    assert s["peer_dflash_tokens_per_s"] is None
    assert s["train"]["steps"] == 4 and s["train"]["tokens_per_s_median"] > 0
    assert s["serve"]["verify"]["ok"] and s["serve"]["generate"]["stored"] == 8
    assert s["multi"] == {
        "multi_backend": "gloo",
        "multi_ranks": 2,
        "multi_exit_codes": [0, 0, 0],
        "multi_complete_checkpoints": [True] * 3,
        "multi_aborted": [False] * 3,
        "multi_ok": True,
    }
    assert set(s["data_path"].values()) == {None}  # part 5 is skipped at the tiny shape
    assert all(p["rc"] == 0 for name, p in s["parts"].items() if name not in ("peer", "loader", "vllm")), s[
        "parts"
    ]
    assert s["parts"]["peer"]["rc"] == "skipped" and s["parts"]["loader"]["rc"] == "skipped"
    assert s["parts"]["vllm"]["rc"] == "skipped" and s["vllm"] is None  # no vLLM CUDA build here


def test_run_all_stops_at_once_when_an_import_fails(tmp_path):
    """A missing wheel on the GPU image ends the run in seconds (device time left for a rerun)."""
    python = tmp_path / "python-without-site"
    python.write_text(f'#!/bin/sh\nexec "{sys.executable}" -S "$@"\n')  # no site-packages: no click, no zarr
    python.chmod(0o755)
    env = {**os.environ, "TINY": "1", "DEVICE": "cpu", "PYTHON": str(python), "OUT": str(tmp_path / "out"),
           "WORK": str(tmp_path / "work"), "CARRY": str(tmp_path / "no-carry")}  # fmt: skip
    r = subprocess.run(
        ["bash", str(GPU / "run_all.sh")], env=env, timeout=600, capture_output=True, text=True
    )
    assert r.returncode == 3
    log = (tmp_path / "out" / "run_all.log").read_text()
    assert "imports failed, stopping: ModuleNotFoundError" in log and "eager" not in log
    assert json.loads((tmp_path / "out" / "summary.json").read_text())["ours"] is None


def test_run_all_reruns_only_the_parts_asked_for(tmp_path):
    env = _env(tmp_path, PARTS="serve", **LOOSE)
    subprocess.run(["bash", str(GPU / "run_all.sh")], env=env, check=True, timeout=600, capture_output=True)
    log = (tmp_path / "out" / "run_all.log").read_text()
    assert "serve (bound" in log and not any(
        f"{k} (bound" in log for k in ("eager-", "peer", "train", "compiled")
    )
    s = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert s["serve"]["verify"]["ok"] and s["ours"] is None and s["train"]["steps"] == 0


def test_summarize_records_parts_and_publishes_them(tmp_path):
    work, out = tmp_path / "work", tmp_path / "out"
    (work / "logs").mkdir(parents=True)
    (work / "logs" / "ours-dflash.json").write_text(json.dumps({"dflash_tokens_per_s": 5.0}) + "\n")
    run = [sys.executable, str(GPU / "summarize.py"), str(work)]
    subprocess.run([*run, "--record", "eager-dflash", "--rc", "0", "--seconds", "12", "--bound", "100",
                    str(work / "logs" / "ours-dflash.json")], check=True)  # fmt: skip
    subprocess.run([*run, "--record", "peer", "--rc", "skipped"], check=True)
    subprocess.run([*run, "--out", str(out)], check=True)
    assert sorted(p.name for p in out.iterdir()) == ["parts.jsonl", "summary.json"]  # no temporary left
    s = json.loads((out / "summary.json").read_text())
    assert s["parts"] == {"eager-dflash": {"rc": 0, "seconds": 12, "bound": 100},
                          "peer": {"rc": "skipped", "seconds": 0, "bound": 0}}  # fmt: skip
    assert s["dflash_tokens_per_s"] == 5.0
    assert _parts(out)["eager-dflash"]["result"] == {"dflash_tokens_per_s": 5.0}


def test_run_all_keeps_to_its_deadline(tmp_path):
    """A part that never ends is cut at the lesser of its bound and the time left; what has under
    15 s left is skipped; the run ends by DEADLINE with every part accounted for. (Under load the
    start-up may eat the whole deadline: then every part is skipped, and the rest still holds.)"""
    deadline = 45
    env = _env(tmp_path, PARTS="eager serve", DEADLINE=str(deadline),
               PYTHON=_hanging_python(tmp_path, "bench_train.py"))  # fmt: skip
    t0 = time.monotonic()
    subprocess.run(["bash", str(GPU / "run_all.sh")], env=env, check=True, timeout=600, capture_output=True)
    # the slack: the records after the deadline's last part, a second each on an idle machine, take
    # several at load 20 on 2 cores
    assert time.monotonic() - t0 < deadline + 120  # not the hanging part's 600 s
    out = tmp_path / "out"
    parts = _parts(out)
    assert list(parts) == ["eager-dflash", "eager-eagle3", "eager-dspark", "serve"]
    log = (out / "run_all.log").read_text()
    for name, grace in (("eager-dflash", 10), ("eager-eagle3", 10), ("eager-dspark", 10), ("serve", 5)):
        if parts[name]["rc"] == "skipped":
            assert f"{name} skipped" in log
            continue
        if name.startswith("eager"):
            assert parts[name]["rc"] == 124  # the hanging part was cut
        # serve (not hanging) may run when the eager parts' bounds left it 15 s or more; it too must
        # have been given no more than the time left
        started = int(log.split(f"] {name} (bound")[0].rsplit("[run_all +", 1)[1].rstrip("s"))
        assert started + parts[name]["bound"] + grace <= deadline
    assert json.loads((out / "summary.json").read_text())["parts"].keys() == parts.keys()


def test_run_all_killed_part_way_has_left_the_finished_parts(tmp_path):
    """Killed as `timeout` kills (SIGTERM to its process group) while the second part runs: the
    first part's figures were in summary.json before the signal (a SIGKILL would keep them too),
    the cut part is recorded, and nothing is left running."""
    work, out = tmp_path / "work", tmp_path / "out"
    env = _env(tmp_path, PARTS="eager", **LOOSE, PYTHON=_hanging_python(tmp_path, "--models eagle3"))
    proc = subprocess.Popen(["bash", str(GPU / "run_all.sh")], env=env, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    try:
        deadline = time.monotonic() + 300
        while not (out / "parts.jsonl").exists() or "eager-dflash" not in _parts(out):
            assert proc.poll() is None and time.monotonic() < deadline, "the first part never finished"
            time.sleep(0.5)
        before = json.loads((out / "summary.json").read_text())
        assert before["dflash_tokens_per_s"] > 0 and before["parts"]["eager-dflash"]["rc"] == 0
        time.sleep(1.0)  # the second part is running (and hangs)
        os.killpg(proc.pid, signal.SIGTERM)
        assert proc.wait(timeout=600) == 143
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    s = json.loads((out / "summary.json").read_text())
    assert s["dflash_tokens_per_s"] == before["dflash_tokens_per_s"] and s["dflash_sync_free"] is True
    assert s["parts"]["eager-eagle3"]["rc"] == "interrupted"
    assert "stopped by a signal during eager-eagle3" in (out / "run_all.log").read_text()
    for _ in range(20):  # the cut part's `timeout` passes the signal on and exits
        if not _left_behind(work):
            break
        time.sleep(0.5)
    assert _left_behind(work) == []
