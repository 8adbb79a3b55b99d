"""``spectrain train --online`` end to end against the reference server, as separate processes.

Every run is checked against the trainer's own record of what it trained: the source logs the
sample ids of each completed optimizer step (``online-consumed-rank0.jsonl``); after a kill and
resume, the steps the crashed run took after its last checkpoint are dropped (the resumed run
trains them again from the checkpointed cursor). Every planned sample must then appear exactly
once per epoch, and the scratch directory must stay under its bound the whole time.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from hsgen.serve.testing import running_server
from hsgen.store import HiddenStateStore
from spectrain.online import dir_bytes

LAYERS = "1,2,4"
BOUND = 3 << 20

pytestmark = pytest.mark.slow


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    return env


def write_prompts(sample_chats_path, path: Path, n: int) -> list[str]:
    lines = Path(sample_chats_path).read_text().splitlines()[:n]
    path.write_text("\n".join(lines) + "\n")
    return [json.loads(x)["id"] for x in lines]


def train_cmd(url, prompts: Path, tiny: Path, tmp: Path, *extra: str) -> list[str]:
    return [
        sys.executable, "-m", "spectrain.cli", "train", "--online",
        "--endpoint", url, "--prompts", str(prompts), "--verifier", str(tiny),
        "--save-path", str(tmp / "save"), "--store", str(tmp / "store"),
        "--shared-dir", str(url.shared_dir), "--scratch-dir", str(tmp / "scratch"),
        "--scratch-bytes", str(BOUND), "--online-option", "layer_ids=[1,2,4]",
        "--total-seq-len", "512", "--block-size", "4", "--num-layers", "1", "--max-anchors", "16",
        "--val-fraction", "0", "--log-every", "1", "--device", "cpu", *extra,
    ]  # fmt: skip


class ScratchWatcher:
    """Polls the scratch directory's size in a thread; ``peak`` is the most it ever held."""

    def __init__(self, path: Path):
        self.path, self.peak, self._stop = path, 0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            if self.path.exists():
                self.peak = max(self.peak, dir_bytes(self.path))
            time.sleep(0.01)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak


def trained_per_epoch(save: Path) -> dict[int, list[str]]:
    """Sample ids trained per epoch in the final model's lineage (steps lost to a crash dropped)."""
    kept: list[dict] = []
    run = None
    for line in (save / "online-consumed-rank0.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if rec["run"] != run:
            run, e, p = rec["run"], rec["epoch"], rec["start_pos"]
            kept = [r for r in kept if r["epoch"] < e or (r["epoch"] == e and max(r["positions"]) < p)]
        kept.append(rec)
    out: dict[int, list[str]] = {}
    for r in kept:
        out.setdefault(r["epoch"], []).extend(r["ids"])
    return out


def last_data_metrics(save: Path) -> dict:
    recs = [json.loads(x) for x in (save / "metrics.jsonl").read_text().splitlines()]
    return [r["data"] for r in recs if "data" in r][-1]


def test_online_training_two_epochs(tiny_model_dir, sample_chats_path, tmp_path):
    ids = write_prompts(sample_chats_path, tmp_path / "p.jsonl", 30)
    with running_server(tiny_model_dir, LAYERS, tmp_path / "hs") as url:
        watch = ScratchWatcher(tmp_path / "scratch")
        cmd = train_cmd(
            url, tmp_path / "p.jsonl", tiny_model_dir, tmp_path, "--epochs", "2", "--delete-consumed"
        )
        proc = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=600)
        peak = watch.stop()
    assert proc.returncode == 0, proc.stderr[-3000:]
    per_epoch = trained_per_epoch(tmp_path / "save")
    assert sorted(per_epoch) == [0, 1]
    for epoch_ids in per_epoch.values():
        assert sorted(epoch_ids) == sorted(ids)
    data = last_data_metrics(tmp_path / "save")
    assert data["samples_failed"] == 0
    # epoch 0's samples are all deleted once consumed (the last ones at the boundary): epoch 1 fetches again
    assert data["samples_generated"] == 2 * len(ids) and data["samples_from_scratch"] == 0
    assert data["overshoots"] == 0
    assert 0 < peak <= BOUND and data["scratch_peak_bytes"] <= BOUND
    assert not (tmp_path / "scratch").exists()  # everything consumed: the scratch store is gone
    assert not list(Path(url.shared_dir).iterdir())  # the server's files were all handed off


def test_mixed_with_concurrent_hsgen_generate(tiny_model_dir, sample_chats_path, tmp_path):
    ids = write_prompts(sample_chats_path, tmp_path / "p.jsonl", 60)
    gen_ids = write_prompts(sample_chats_path, tmp_path / "gen.jsonl", 40)  # the rest only online
    # slow enough that hsgen generate is still writing when the trainer starts reading
    with running_server(
        tiny_model_dir, LAYERS, tmp_path / "hs", capacity="tokens_per_s=1500,max_seqs=8"
    ) as url:
        gen = subprocess.Popen(
            [
                sys.executable, "-m", "hsgen.cli", "generate", str(tmp_path / "gen.jsonl"),
                "--store", str(tmp_path / "store"), "--endpoint", url, "--shared-dir", str(url.shared_dir),
                "--layer-ids", LAYERS, "--tokenizer", str(tiny_model_dir), "--verifier", str(tiny_model_dir),
                "--no-progress", "--shard-mb", "0.2", "--commit-interval", "0.2",
            ],
            env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        watch = ScratchWatcher(tmp_path / "scratch")
        cmd = train_cmd(
            url, tmp_path / "p.jsonl", tiny_model_dir, tmp_path, "--epochs", "1", "--delete-consumed"
        )
        proc = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=600)
        gen_out, gen_err = gen.communicate(timeout=600)
        peak = watch.stop()
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert gen.returncode == 0, gen_err[-3000:]
    assert sorted(trained_per_epoch(tmp_path / "save")[0]) == sorted(ids)
    data = last_data_metrics(tmp_path / "save")
    assert data["samples_failed"] == 0
    assert data["samples_from_cache"] + data["samples_generated"] >= len(ids)
    assert data["samples_from_cache"] > 0, "the trainer read nothing hsgen generate had stored"
    assert data["samples_generated"] > 0, "the trainer fetched nothing itself"
    store = HiddenStateStore.open(tmp_path / "store")
    assert sorted(store.sample_ids()) == sorted(gen_ids)  # generate finished its part, once
    assert store.stats()["duplicates"] == 0
    assert store.verify() == []
    assert peak <= BOUND


def test_kill_and_resume_trains_every_sample_once(tiny_model_dir, sample_chats_path, tmp_path):
    ids = write_prompts(sample_chats_path, tmp_path / "p.jsonl", 40)
    save = tmp_path / "save"
    with running_server(
        tiny_model_dir, LAYERS, tmp_path / "hs", capacity="tokens_per_s=6000,max_seqs=4"
    ) as url:
        watch = ScratchWatcher(tmp_path / "scratch")
        cmd = train_cmd(
            url, tmp_path / "p.jsonl", tiny_model_dir, tmp_path, "--epochs", "2", "--delete-consumed",
            "--save-every", "3", "--online-option", "persist_fetched=true",  # the scratch-store mode
        )  # fmt: skip
        first = subprocess.Popen(
            cmd, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
        )
        log = save / "online-consumed-rank0.jsonl"
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline and first.poll() is None:
            steps = len(log.read_text().splitlines()) if log.exists() else 0
            if any(save.glob("checkpoint-*")) and steps >= 5:
                break
            time.sleep(0.05)
        assert first.poll() is None, "the run ended before it could be killed"
        os.kill(first.pid, signal.SIGKILL)
        first.wait()
        stderr_first = first.stderr.read()
        first.stderr.close()
        steps_before = len(log.read_text().splitlines())
        scratch = HiddenStateStore.open(tmp_path / "scratch")
        assert scratch.verify() == []  # whatever the killed run left is whole
        second = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=600)
        peak = watch.stop()
    assert second.returncode == 0, second.stderr[-3000:] + stderr_first[-1000:]
    assert "resumed from" in second.stderr
    per_epoch = trained_per_epoch(save)
    assert sorted(per_epoch) == [0, 1]
    for epoch_ids in per_epoch.values():
        assert sorted(epoch_ids) == sorted(ids)
    assert steps_before >= 5
    assert peak <= BOUND
    assert last_data_metrics(save)["samples_failed"] == 0


def test_kill_9_of_a_read_once_run_resumes_exactly_and_leaves_no_server_file(
    tiny_model_dir, sample_chats_path, tmp_path
):
    """The default with --delete-consumed (each fetched sample read once from memory) killed with -9:
    the resumed run trains every sample once per epoch within the bound, and no file the server
    wrote for the killed run is left in the shared directory; another client's files stay."""
    ids = write_prompts(sample_chats_path, tmp_path / "p.jsonl", 40)
    save, shared = tmp_path / "save", tmp_path / "hs"
    shared.mkdir()
    planted = [  # another hsgen client's request and its lock, and a file of a client without a prefix
        "cmpl-hsgen-0f0f0f0f0f0f-0123456789abcdef-0-cccccccc.safetensors",
        "cmpl-hsgen-0f0f0f0f0f0f-0123456789abcdef-0-cccccccc.safetensors.lock",
        "cmpl-0123456789abcdef-0-dddddddd.safetensors",
    ]
    for name in planted:
        (shared / name).write_bytes(b"not ours")
    with running_server(tiny_model_dir, LAYERS, shared, capacity="tokens_per_s=6000,max_seqs=4") as url:
        cmd = train_cmd(
            url, tmp_path / "p.jsonl", tiny_model_dir, tmp_path, "--epochs", "2", "--delete-consumed",
            "--save-every", "3",
        )  # fmt: skip
        first = subprocess.Popen(cmd, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        log = save / "online-consumed-rank0.jsonl"
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline and first.poll() is None:
            steps = len(log.read_text().splitlines()) if log.exists() else 0
            in_flight = set(os.listdir(shared)) - set(planted)
            if any(save.glob("checkpoint-*")) and steps >= 5 and in_flight:
                break
            time.sleep(0.02)
        assert first.poll() is None, "the run ended before it could be killed"
        os.kill(first.pid, signal.SIGKILL)
        first.wait()
        time.sleep(1.0)  # the server finishes the dead run's requests: their files stay behind
        (dead,) = [json.loads(p.read_text()) for p in (save / ".leases").glob("*.json")]
        orphans = [n for n in os.listdir(shared) if n.startswith("cmpl-" + dead["request_prefix"])]
        assert orphans, "the kill left no server file: the test proves nothing"
        second = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=600)
        left = sorted(os.listdir(shared))
    assert second.returncode == 0, second.stderr[-3000:]
    assert "resumed from" in second.stderr
    per_epoch = trained_per_epoch(save)
    assert sorted(per_epoch) == [0, 1]
    for epoch_ids in per_epoch.values():
        assert sorted(epoch_ids) == sorted(ids)
    data = last_data_metrics(save)
    assert data["samples_failed"] == 0 and data["samples_from_scratch"] == 0
    assert 0 < data["held_peak_bytes"] <= BOUND  # fetched samples were held in memory, within the bound
    assert data["orphans_removed"] >= len(orphans)
    assert left == sorted(planted)  # nothing of either run is left; the other clients' files are


def test_torchrun_ranks_fetch_and_train_only_their_share(tiny_model_dir, sample_chats_path, tmp_path):
    from spectrain.data.sources import epoch_plan

    ids = write_prompts(sample_chats_path, tmp_path / "p.jsonl", 30)
    with running_server(tiny_model_dir, LAYERS, tmp_path / "hs") as url:
        watch = ScratchWatcher(tmp_path / "scratch")
        args = train_cmd(
            url, tmp_path / "p.jsonl", tiny_model_dir, tmp_path, "--epochs", "2", "--delete-consumed"
        )[3:]  # from "train" on
        at = args.index("--endpoint")  # spelled as in the public tool, which users carry over
        args[at : at + 2] = ["--vllm-endpoint", f"{url}/v1"]
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               "-m", "spectrain.cli", *args]  # fmt: skip
        proc = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=300)
        peak = watch.stop()
        leftover = list(Path(url.shared_dir).iterdir())
    assert proc.returncode == 0, proc.stderr[-3000:]
    save = tmp_path / "save"
    for epoch in (0, 1):
        plans = [epoch_plan(ids, epoch, 0, rank, 2) for rank in (0, 1)]
        assert not set(plans[0]) & set(plans[1]) and sorted(plans[0] + plans[1]) == sorted(ids)
        trained = []
        for rank in (0, 1):
            recs = [
                json.loads(x) for x in (save / f"online-consumed-rank{rank}.jsonl").read_text().splitlines()
            ]
            got = [i for r in recs if r["epoch"] == epoch for i in r["ids"]]
            # each rank trains its own plan in order, once; ranks step together, so the rank
            # whose samples pack into more sequences drops its last ones (as offline)
            assert got == plans[rank][: len(got)] and len(got) >= len(plans[rank]) - 3
            trained += got
        assert len(trained) == len(set(trained))
    data = last_data_metrics(save)  # rank 0's source
    assert data["samples_failed"] == 0
    assert len(plans[0]) <= data["samples_generated"] <= 2 * len(plans[0])  # its share, not the others'
    assert {p.name for p in (tmp_path / "scratch").iterdir()} <= {"rank0", "rank1"}
    assert not any((tmp_path / "scratch").iterdir())  # both ranks' scratch stores removed at the end
    assert 0 < peak <= 2 * BOUND
    assert not leftover  # every file the server wrote was handed off


def test_pipeline_render_into_online_training_via_stdin(tiny_model_dir, sample_chats_path, tmp_path):
    from spectrain.data.sources import split_of

    ids = write_prompts(sample_chats_path, tmp_path / "p.jsonl", 30)
    with running_server(tiny_model_dir, LAYERS, tmp_path / "hs") as url:
        cmd = train_cmd(url, tmp_path / "p.jsonl", tiny_model_dir, tmp_path, "--epochs", "1")
        cmd[cmd.index("--prompts") + 1] = "-"
        cmd[cmd.index("--val-fraction") + 1] = "0.2"  # the validation source shares what stdin gave
        render = subprocess.Popen(
            [sys.executable, "-m", "hsgen.cli", "render", str(tmp_path / "p.jsonl"),
             "--tokenizer", str(tiny_model_dir)],
            env=_env(), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        proc = subprocess.run(
            cmd, env=_env(), stdin=render.stdout, capture_output=True, text=True, timeout=600
        )
        render.stdout.close()
        assert render.wait(timeout=600) == 0
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["validation"]["sequences"] > 0
    assert summary["data"]["samples_failed"] == 0 and summary["data"]["samples_generated"] > 0
    train_ids = [i for i in ids if split_of(i, 0.2) == "train"]
    assert 0 < len(train_ids) < len(ids)
    assert sorted(trained_per_epoch(tmp_path / "save")[0]) == sorted(train_ids)
