"""The speculators flags scripts set most, mapped: ``--run-name`` names the trackers' run and the
report, ``--checkpoint-freq`` (epochs) becomes a step interval the run logs, ``--save-best`` keeps
the checkpoint of the best validation tau (never pruned)."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from spectrain.cli.speculators_flags import translate
from spectrain.cli.train import build_train_config, train

TINY = [
    "--speculator-type",
    "dflash",
    "--block-size",
    "4",
    "--num-layers",
    "1",
    "--max-anchors",
    "16",
    "--total-seq-len",
    "512",
]


def _cfg(argv):
    return build_train_config(train.make_context("train", translate(argv, train).tokens).params)


def test_the_flags_translate(tmp_path, tiny_store, tiny_model_dir):
    base = ["--store", str(tiny_store), "--speculator-type", "dflash", "--verifier-name-or-path", str(tiny_model_dir), "--save-path",
            str(tmp_path / "r")]  # fmt: skip
    cfg = _cfg([*base, "--run-name", "exp_{rank}", "--checkpoint-freq", "0.5", "--save-best"])
    assert (cfg.run_name, cfg.save_every_epochs, cfg.save_best) == ("exp_{rank}", 0.5, True)
    with pytest.raises(click.UsageError, match="give one of them"):
        _cfg([*base, "--checkpoint-freq", "2", "--save-every", "10"])
    with pytest.raises(ValueError, match="save_best: needs a validation split"):
        _cfg([*base, "--save-best", "--val-fraction", "0"])


def test_checkpoint_freq_save_best_and_run_name_in_a_run(tmp_path, tiny_store, tiny_model_dir, caplog):
    from spectrain.cli import main

    save = tmp_path / "run"
    argv = ["train", "--store", str(tiny_store), "--verifier-name-or-path", str(tiny_model_dir), "--save-path",
            str(save), *TINY, "--epochs", "2", "--train-data-ratio", "0.8", "--checkpoint-freq", "0.5",
            "--save-best", "--run-name", "exp-{rank}", "--val-every", "3", "--keep-checkpoints", "1",
            "--log-freq", "1", "--lr", "3e-3"]  # fmt: skip
    plan = CliRunner().invoke(main, [*argv, "--dry-run"])
    assert plan.exit_code == 0, plan.output
    planned = json.loads(plan.stdout.strip().splitlines()[-1])
    per_epoch, every = planned["data"]["steps_per_epoch"], planned["checkpoints"]["save_every"]
    assert every == max(1, round(0.5 * per_epoch)) and "steps per epoch" in planned["checkpoints"]["note"]

    with caplog.at_level(logging.INFO, logger="spectrain"):
        res = CliRunner().invoke(main, argv)
    assert res.exit_code == 0, res.output
    assert f"a checkpoint every {every} steps ({per_epoch} steps per epoch)" in caplog.text
    summary = json.loads(res.stdout.strip().splitlines()[-1])

    records = [json.loads(line) for line in (save / "metrics.jsonl").read_text().splitlines()]
    vals = [r for r in records if r.get("split") == "validation"]
    assert len(vals) >= 3
    best = max(vals, key=lambda r: r["tau"])  # the first of equal taus: a later one must beat it
    best = next(r for r in vals if r["tau"] == best["tau"])
    name = (save / "best").read_text().strip()
    assert name == f"checkpoint-{best['step']:08d}" and summary["best"]["tau"] == best["tau"]
    kept = sorted(p.name for p in save.glob("checkpoint-*"))
    latest = (save / "latest").read_text().strip()
    assert kept == sorted({name, latest})  # --keep-checkpoints 1 pruned all but the newest, and the best
    assert int(latest.split("-")[1]) == summary["step"]
    saved = [int(m) for m in re.findall(r"saved \S+/checkpoint-(\d+)", caplog.text)]
    improved = {r["step"] for r in vals if r["tau"] > max([v["tau"] for v in vals if v["step"] < r["step"]],
                                                           default=float("-inf"))}  # fmt: skip
    on_interval = [s for s in saved if s % every == 0]
    assert on_interval and set(saved) <= {*on_interval, *improved, summary["step"]}, (saved, every, improved)
    print("saved", saved, "every", every, "improved", improved, "best", name, "latest", latest)

    train_cfg = json.loads((save / latest / "trainer" / "train_config.json").read_text())["train"]
    assert train_cfg["run_name"] == "exp-0"  # filled in once, as the trackers saw it
    from spectrain.eval.report import write_report

    page = Path(write_report(save)["html"]).read_text()
    assert "<title>spectrain run exp-0</title>" in page
