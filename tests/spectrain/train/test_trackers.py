"""``--report-to``: TensorBoard event files from a real run; wandb/trackio adapters and their hints."""

from __future__ import annotations

import sys
import types

import pytest

from spectrain.train.loop import TrainConfig, train
from spectrain.train.trackers import Trackers, flatten, parse_report_to


def test_parse_and_flatten():
    assert parse_report_to(["wandb,tensorboard", "wandb", "none"]) == ["wandb", "tensorboard"]
    with pytest.raises(ValueError, match="unknown tracker 'mlflow'"):
        parse_report_to("mlflow")
    rec = {
        "split": "train",
        "step": 3,
        "loss": 2.0,
        "acc": [0.5, 0.25],
        "data": {"samples_generated": 7, "x": "s"},
    }
    assert flatten(rec) == {
        "train/loss": 2.0,
        "train/acc_1": 0.5,
        "train/acc_2": 0.25,
        "train/data/samples_generated": 7.0,
    }


def test_tensorboard_gets_every_record_of_a_real_run(tiny_store, tiny_model_dir, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    save = tmp_path / "run"
    cfg = TrainConfig(store=str(tiny_store), verifier=str(tiny_model_dir), save_path=str(save), report_to=["tensorboard"],
                      draft={"block_size": 4, "max_anchors": 16, "num_layers": 1}, total_seq_len=256, max_steps=4,
                      log_every=2, save_every=0, val_fraction=0.1, val_every=2)  # fmt: skip
    train(cfg)
    acc = EventAccumulator(str(save / "tensorboard"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {
        "train/loss",
        "train/lr",
        "train/tokens_per_s",
        "train/acc_1",
        "train/acc_3",
        "validation/tau",
    } <= tags
    assert [e.step for e in acc.Scalars("train/loss")] == [2, 4]


@pytest.mark.parametrize("name", ["wandb", "trackio"])
def test_missing_tracker_package_gives_the_pip_hint(name, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(
        RuntimeError, match=f"--report-to {name} needs the {name} package: pip install {name}"
    ):
        Trackers([name], tmp_path)


def test_wandb_and_trackio_adapters(tmp_path, monkeypatch):
    calls = []

    class Run:
        def log(self, scalars, step):
            calls.append(("wandb", scalars, step))

        def finish(self):
            calls.append(("wandb", "finish"))

    wandb = types.SimpleNamespace(
        init=lambda **kw: calls.append(("wandb.init", kw["project"], kw["name"])) or Run()
    )
    trackio = types.SimpleNamespace(init=lambda **kw: calls.append(("trackio.init", kw["project"])),
                                    log=lambda scalars, step: calls.append(("trackio", scalars, step)),
                                    finish=lambda: calls.append(("trackio", "finish")))  # fmt: skip
    monkeypatch.setitem(sys.modules, "wandb", wandb)
    monkeypatch.setitem(sys.modules, "trackio", trackio)
    monkeypatch.setenv("WANDB_PROJECT", "drafts")
    t = Trackers(["wandb", "trackio"], tmp_path / "run1")
    t.log({"split": "validation", "step": 5, "tau": 1.5})
    t.close()
    assert calls == [("wandb.init", "drafts", "run1"), ("trackio.init", "spectrain"),
                     ("wandb", {"validation/tau": 1.5}, 5), ("trackio", {"validation/tau": 1.5}, 5),
                     ("wandb", "finish"), ("trackio", "finish")]  # fmt: skip
