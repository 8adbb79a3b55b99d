"""The training loop: CLI run, metrics, servable checkpoints, resume equality (also after a real
kill), and a 2-process gloo DDP run."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from spectrain.train.loop import TrainConfig, train


def _cfg(store, verifier, save, **kw) -> TrainConfig:
    base = dict(
        store=str(store), verifier=str(verifier), save_path=str(save), speculator_type="dflash",
        draft={"block_size": 4, "max_anchors": 16, "num_layers": 1}, total_seq_len=256, epochs=2,
        lr=3e-3, save_every=0, log_every=1, num_workers=0, val_fraction=0.1, seed=1, warmup_steps=2,
    )  # fmt: skip
    base.update(kw)
    return TrainConfig(**base)


def _state(ckpt: Path) -> dict:
    return torch.load(ckpt / "trainer" / "state.pt", map_location="cpu", weights_only=False)


def _same_training_state(a: dict, b: dict) -> None:
    assert a["loop"]["global_step"] == b["loop"]["global_step"]
    assert a["loop"]["epoch"] == b["loop"]["epoch"] and a["loop"]["positions"] == b["loop"]["positions"]
    assert a["model"].keys() == b["model"].keys()
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k
    for opt_a, opt_b in zip(a["optimizer"], b["optimizer"], strict=True):  # Muon and AdamW for DFlash
        for pid, st in opt_a["state"].items():
            for name, value in st.items():
                assert torch.equal(value, opt_b["state"][pid][name]), name
    assert a["scheduler"] == b["scheduler"]


def test_cli_train_writes_servable_checkpoints_and_metrics(tiny_store, tiny_model_dir, tmp_path):
    from spectrain.cli import main

    save = tmp_path / "run"
    cfg_file = tmp_path / "cfg.json"
    cfg_file.write_text(json.dumps({"lr": 2e-3, "draft": {"ttt_steps": 3}, "val_every": 3}))
    args = ["train", "--config", str(cfg_file), "--store", str(tiny_store), "--verifier", str(tiny_model_dir),
            "--speculator-type", "eagle3", "--save-path", str(save), "--total-seq-len", "256", "--max-steps", "6",
            "--save-every", "4", "--log-every", "2", "--num-workers", "1", "--draft-vocab-size", "300",
            "--verifier-name", "Qwen/Qwen3-8B", "--val-fraction", "0.1"]  # fmt: skip
    res = CliRunner().invoke(main, args, catch_exceptions=False)
    assert res.exit_code == 0, res.output
    summary = json.loads(res.stdout.strip().splitlines()[-1])
    assert summary["step"] == 6
    assert (save / "latest").read_text().strip() == "checkpoint-00000006"
    for step in (4, 6):
        ck = save / f"checkpoint-{step:08d}"
        assert (ck / "model.safetensors").is_file()
        cfg = json.loads((ck / "config.json").read_text())
        assert cfg["speculators_model_type"] == "eagle3" and cfg["draft_vocab_size"] == 300
    resolved = json.loads((save / "checkpoint-00000006" / "trainer" / "train_config.json").read_text())
    assert resolved["train"]["lr"] == 2e-3 and resolved["draft"]["aux_layer_ids"] == [1, 2, 3]
    records = [json.loads(line) for line in (save / "metrics.jsonl").read_text().splitlines()]
    train_recs = [r for r in records if r["split"] == "train"]
    assert [r["step"] for r in train_recs] == [2, 4, 6]
    for r in train_recs:
        assert r["data_wait_s"] >= 0 and r["tokens_per_s"] > 0 and len(r["acc"]) == 3 and r["tau"] >= 1
        assert 0 <= r["data_wait_fraction"] <= 1
    val = [r for r in records if r["split"] == "validation"]
    assert [r["step"] for r in val] == [3, 6] and val[0]["sequences"] > 0 and len(val[0]["acc"]) == 3
    # re-export with another verifier name
    res = CliRunner().invoke(main, ["export", str(save / "checkpoint-00000006"), str(tmp_path / "exp"),
                                    "--verifier-name", "org/model"])  # fmt: skip
    assert res.exit_code == 0, res.output
    cfg = json.loads((tmp_path / "exp" / "config.json").read_text())
    assert cfg["speculators_config"]["verifier"]["name_or_path"] == "org/model"


def test_cli_rejects_bad_options(tiny_store, tiny_model_dir, tmp_path):
    from spectrain.cli import main

    base = [
        "train",
        "--store",
        str(tiny_store),
        "--verifier",
        str(tiny_model_dir),
        "--save-path",
        str(tmp_path),
    ]
    res = CliRunner().invoke(main, [*base, "--speculator-type", "eagle3", "--block-size", "4"])
    assert res.exit_code != 0 and "block_size" in res.output
    res = CliRunner().invoke(main, [*base, "--target-layer-ids", "1 2 9"])
    assert res.exit_code != 0 and "not in the store" in res.output


def test_resume_equals_straight_run(tiny_store, tiny_model_dir, tmp_path):
    torch.set_num_threads(1)
    straight = train(_cfg(tiny_store, tiny_model_dir, tmp_path / "a"))
    total = straight["step"]
    assert total > 4
    first = train(_cfg(tiny_store, tiny_model_dir, tmp_path / "b", stop_after_steps=total // 2 + 1))
    assert first["step"] == total // 2 + 1
    st = _state(Path(first["checkpoint"]))
    assert st["loop"]["epoch"] == 0 or st["loop"]["positions"][0] > 0  # stopped mid-epoch
    resumed = train(_cfg(tiny_store, tiny_model_dir, tmp_path / "b"))
    assert resumed["step"] == total
    _same_training_state(_state(Path(straight["checkpoint"])), _state(Path(resumed["checkpoint"])))


def test_resume_after_the_last_epoch_plans_the_next_one_afresh(tiny_store, tiny_model_dir, tmp_path):
    """A finished run continued with more epochs trains the next epoch in that epoch's own order,
    as an uninterrupted run does (its last checkpoint lies between epochs and holds no plan)."""
    torch.set_num_threads(1)
    one = train(_cfg(tiny_store, tiny_model_dir, tmp_path / "b", epochs=1))
    st = _state(Path(one["checkpoint"]))
    assert st["loop"]["epoch"] == 1 and st["loop"]["positions"] == [0] and st["plans"] is None
    steps = one["step"]
    straight = train(_cfg(tiny_store, tiny_model_dir, tmp_path / "a", stop_after_steps=steps + 1))
    resumed = train(_cfg(tiny_store, tiny_model_dir, tmp_path / "b", stop_after_steps=steps + 1))
    a, b = _state(Path(straight["checkpoint"])), _state(Path(resumed["checkpoint"]))
    assert a["loop"]["epoch"] == b["loop"]["epoch"] == 1 and a["loop"]["positions"] == b["loop"]["positions"]
    assert b["plans"] == a["plans"], "the resumed run repeated the last epoch's order"


def test_kill_mid_epoch_then_resume(tiny_store, tiny_model_dir, tmp_path):
    kw = dict(
        epochs=1, total_seq_len=96, speculator_type="eagle3", draft={"draft_vocab_size": 200, "ttt_steps": 2}
    )
    straight = train(_cfg(tiny_store, tiny_model_dir, tmp_path / "a", **kw))
    save = tmp_path / "b"
    cmd = [sys.executable, "-m", "spectrain.cli", "train", "--store", str(tiny_store), "--verifier",
           str(tiny_model_dir), "--save-path", str(save), "--speculator-type", "eagle3", "--draft-vocab-size",
           "200", "--ttt-steps", "2", "--total-seq-len", "96", "--epochs", "1", "--lr", "3e-3", "--save-every",
           "2", "--log-every", "1", "--num-workers", "0", "--val-fraction", "0.1", "--seed", "1",
           "--warmup-steps", "2"]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    try:
        deadline = time.time() + 600
        while time.time() < deadline and not (save / "latest").is_file():
            time.sleep(0.05)
        assert (save / "latest").is_file(), "no checkpoint appeared"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    killed_at = _state(save / (save / "latest").read_text().strip())["loop"]["global_step"]
    assert killed_at < straight["step"], "the run finished before it was killed"
    resumed = train(_cfg(tiny_store, tiny_model_dir, save, **kw))
    assert resumed["step"] == straight["step"]
    _same_training_state(_state(Path(straight["checkpoint"])), _state(Path(resumed["checkpoint"])))


def _signal_after_three_steps(cmd, env, save: Path, sig) -> tuple[subprocess.Popen, str, str]:
    """Start ``cmd``, send ``sig`` once three steps are logged; the process, its stdout and stderr."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        deadline = time.time() + 600  # start-up alone took over 120 s at load 23 on 2 cores
        metrics = save / "metrics.jsonl"
        stepped = False
        while time.time() < deadline and proc.poll() is None:
            if metrics.is_file() and len(metrics.read_text().splitlines()) >= 3:
                stepped = True
                break
            time.sleep(0.05)
        assert proc.poll() is None, proc.stderr.read()[-2000:]
        assert stepped, "three steps not logged within 600 s"  # a signal before the loop would test nothing
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=600)
    finally:
        proc.kill()
    return proc, out, err


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_saves_a_checkpoint_and_exits_128_plus_signal(tiny_store, tiny_model_dir, tmp_path, sig):
    save = tmp_path / "run"
    cmd = [sys.executable, "-m", "spectrain.cli", "train", "--store", str(tiny_store), "--verifier",
           str(tiny_model_dir), "--save-path", str(save), "--total-seq-len", "96", "--block-size", "4",
           "--max-anchors", "16", "--num-layers", "1", "--epochs", "1000", "--save-every", "0",
           "--log-every", "1", "--val-fraction", "0.1", "--device", "cpu"]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc, out, err = _signal_after_three_steps(cmd, env, save, sig)
    assert proc.returncode == 128 + sig, err[-2000:]
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["stopped_by"] == sig.name and summary["step"] >= 3
    latest = save / (save / "latest").read_text().strip()
    assert _state(latest)["loop"]["global_step"] == summary["step"]  # saved where it stopped
    again = subprocess.run([*cmd, "--stop-after-steps", str(summary["step"] + 2)], capture_output=True,
                           text=True, env=env, timeout=600)  # fmt: skip
    assert again.returncode == 0, again.stderr[-2000:]
    resumed = json.loads(again.stdout.strip().splitlines()[-1])
    assert resumed["step"] == summary["step"] + 2 and "stopped_by" not in resumed


def test_sigterm_under_torchrun_stops_every_rank_at_one_step(tiny_store, tiny_model_dir, tmp_path):
    save = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "-m", "spectrain.cli", "train", "--store", str(tiny_store), "--verifier", str(tiny_model_dir),
           "--save-path", str(save), "--total-seq-len", "96", "--block-size", "4", "--max-anchors", "16",
           "--num-layers", "1", "--epochs", "1000", "--save-every", "0", "--log-every", "1",
           "--val-fraction", "0.1", "--device", "cpu"]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    _, out, err = _signal_after_three_steps(
        cmd, env, save, signal.SIGTERM
    )  # torchrun forwards it to both workers
    summaries = [json.loads(x) for x in out.splitlines() if x.startswith("{")]
    assert len(summaries) == 1, out  # rank 0 alone prints it
    assert summaries[0]["stopped_by"] == "SIGTERM", err[-2000:]
    st = _state(save / (save / "latest").read_text().strip())
    assert st["loop"]["global_step"] == summaries[0]["step"] >= 3
    assert st["loop"]["world_size"] == 2 and len(st["loop"]["positions"]) == 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_two_process_gloo(tiny_store, tiny_model_dir, tmp_path, strategy):
    import torch.multiprocessing as mp

    sys.path.insert(0, str(Path(__file__).parents[1]))
    from _dist_worker import run_rank

    cfg = _cfg(tiny_store, tiny_model_dir, tmp_path / "run", epochs=1, distributed=strategy).to_dict()
    mp.spawn(run_rank, args=(2, _free_port(), cfg, str(tmp_path)), nprocs=2, join=True)
    r0 = json.loads((tmp_path / "rank0.json").read_text())
    r1 = json.loads((tmp_path / "rank1.json").read_text())
    assert r0["digest"] == r1["digest"], "ranks diverged"
    assert r0["step"] == r1["step"] > 0
    assert r0["torn_down"] and r1["torn_down"], "Trainer.close destroys the process group it made"
    assert not set(r0["plan"]) & set(r1["plan"])
    st = _state(tmp_path / "run" / (tmp_path / "run" / "latest").read_text().strip())
    assert st["loop"]["world_size"] == 2 and len(st["loop"]["positions"]) == 2
    assert st["loop"]["epoch"] == 1 and st["loop"]["positions"] == [0, 0] and st["plans"] is None


@pytest.mark.parametrize(("algorithm", "empty"), [("dflash", "no-loss"), ("eagle3", "no-loss"),
                                                  ("dflash", "nothing")])  # fmt: skip
def test_metric_reduction_with_a_rank_without_loss_tokens(tmp_path, algorithm, empty):
    """A rank whose sequence has no loss tokens (so no DFlash anchors) reduces with the others:
    no hang, and both ranks get the same summary, equal to rank 0's own."""
    import torch.multiprocessing as mp

    sys.path.insert(0, str(Path(__file__).parents[1]))
    from _dist_worker import metrics_rank

    ctx = mp.spawn(
        metrics_rank, args=(2, _free_port(), algorithm, empty, str(tmp_path)), nprocs=2, join=False
    )
    deadline = time.monotonic() + 600
    while not ctx.join(timeout=1):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail("metric reduction hung")
    r0 = json.loads((tmp_path / "metrics0.json").read_text())
    r1 = json.loads((tmp_path / "metrics1.json").read_text())
    assert r0["together"] == r1["together"] == r0["alone"]
    assert len(r0["alone"]["acc"]) == 3 and r0["alone"]["tau"] >= 1.0 and r0["alone"]["loss"] > 0


def test_per_step_decisions_use_a_host_group_beside_nccl(tmp_path):
    """Where the default group is not gloo (NCCL), the loop's per-step minimum goes over a gloo
    group on host tensors, so deciding whether to go on never waits for the device."""
    import torch.multiprocessing as mp

    sys.path.insert(0, str(Path(__file__).parents[1]))
    from _dist_worker import control_rank

    mp.spawn(control_rank, args=(2, _free_port(), str(tmp_path)), nprocs=2, join=True)
    for rank in (0, 1):
        r = json.loads((tmp_path / f"control{rank}.json").read_text())
        assert r["control_backend"] == "gloo"
        assert r["min_each"] == [1, 9]
        assert r["control_destroyed"] and r["default_kept"]


def test_no_save_final_writes_no_checkpoint(tiny_store, tiny_model_dir, tmp_path):
    """``--save-every 0 --no-save-final``: a benchmark run trains and logs, and writes no weights."""
    from spectrain.cli import main

    save = tmp_path / "run"
    args = ["train", "--store", str(tiny_store), "--verifier", str(tiny_model_dir), "--speculator-type", "dflash",
            "--save-path", str(save), "--total-seq-len", "256", "--max-steps", "2", "--save-every", "0",
            "--no-save-final", "--log-every", "1", "--num-layers", "1", "--block-size", "4", "--max-anchors", "8",
            "--val-fraction", "0"]  # fmt: skip
    res = CliRunner().invoke(main, args, catch_exceptions=False)
    assert res.exit_code == 0, res.output
    summary = json.loads(res.stdout.strip().splitlines()[-1])
    assert summary["step"] == 2 and summary["checkpoint"] is None
    assert not list(save.glob("checkpoint-*")) and (save / "metrics.jsonl").exists()
