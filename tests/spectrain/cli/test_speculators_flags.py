"""speculators' train vocabulary on ``spectrain train``: every flag of speculators 0.9.0's own
parser is accepted with the same meaning or refused in one line naming ours; --dry-run plans."""

from __future__ import annotations

import json
import re
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from spectrain.cli.speculators_flags import DSPARK_ONLY, FLAGS, markdown_table, translate
from spectrain.cli.train import build_train_config, train

ROOT = Path(__file__).resolve().parents[3]


def _speculators_actions():
    resolution = pytest.importorskip(
        "speculators.train.config.resolution", reason="scripts/install.sh installs speculators 0.9.0"
    )
    return [a for a in resolution.build_parser()._actions if a.dest != "help"]


def _example(action, tmp_path: Path, model_dir: Path) -> list[str]:
    special = {"--verifier-name-or-path": [str(model_dir)], "--speculator-type": ["dflash"],
               "--draft-arch": ["qwen3"], "--draft-hidden-act": ["silu"], "--loss-fn": ["ce"],
               "--scheduler-num-cosine-cycles": ["0.5"], "--hidden-states-dtype": ["bfloat16"],
               "--logger": ["tensorboard"], "--from-pretrained": [str(tmp_path)], "--data-path": [str(tmp_path)],
               "--config": [str(tmp_path / "run.yaml")], "--vllm-endpoint": ["http://127.0.0.1:9/v1"]}  # fmt: skip
    name = action.option_strings[0]
    if name in special:
        return special[name]
    if action.nargs == 0:
        return []
    if action.choices:
        return [str(list(action.choices)[0])]
    value = {int: "2", float: "0.5"}.get(action.type, "x")
    return [value, "3"] if action.nargs == "+" else [value]


def test_the_table_covers_exactly_speculators_flags():
    theirs = {s for a in _speculators_actions() for s in a.option_strings}
    assert theirs == set(FLAGS), (sorted(theirs - set(FLAGS)), sorted(set(FLAGS) - theirs))


def test_every_flag_is_accepted_or_refused_in_one_line_naming_ours(tmp_path, tiny_store, tiny_model_dir):
    (tmp_path / "run.yaml").write_text("train:\n  trainer:\n    epochs: 3\n")
    base = ["--store", str(tiny_store), "--verifier", str(tiny_model_dir), "--save-path", str(tmp_path / "r")]
    accepted = refused = 0
    for action in _speculators_actions():
        for spelling in action.option_strings:
            argv = [
                *base,
                *(["--speculator-type", "dspark"] if spelling in DSPARK_ONLY else []),
                spelling,
                *([] if spelling.startswith("--no-") else _example(action, tmp_path, tiny_model_dir)),
            ]
            flag = FLAGS[spelling]
            if flag.accepted:
                tokens = translate(argv, train).tokens
                train.make_context("train", tokens)  # click accepts what the flag became
                accepted += 1
                continue
            with pytest.raises(click.UsageError) as e:
                translate(argv, train)
            msg = e.value.message
            assert msg.startswith(f"{spelling}: ") and "\n" not in msg, msg
            assert re.search(r"--[a-z]|hsgen|spectrain|draft|no ", msg.removeprefix(spelling)), msg
            refused += 1
    assert accepted > 50 and refused > 30  # the split as documented in docs/train.md


def _cfg(argv):
    return build_train_config(train.make_context("train", translate(argv, train).tokens).params)


def test_translated_flags_keep_speculators_meaning(tmp_path, tiny_store, tiny_model_dir):
    base = ["--store", str(tiny_store), "--speculator-type", "dflash", "--verifier-name-or-path", str(tiny_model_dir), "--save-path",
            str(tmp_path / "r")]  # fmt: skip
    cfg = _cfg(
        [
            *base,
            "--loss-fn",
            "kl_div",
            "--train-data-ratio",
            "0.9",
            "--target-layer-ids",
            "1",
            "2",
            "3",
            "--scheduler-type=none",
            "--no-resume-from-checkpoint",
            "--fsdp-shard",
            "--log-freq",
            "1",
            "--per-position-loss-weight",
            "fixed-exp-decay",
            "--dflash-decay-gamma",
            "4.0",
            "--no-sliding-window-non-causal",
            "--hidden-states-dtype",
            "float32",
            "--muon-adjust-lr-fn",
            "original",
            "--scheduler-warmup-steps",
            "5",
            "--num-workers",
            "2",
            "--prefetch-factor",
            "4",
        ]
    )
    assert cfg.draft["target_mode"] == "soft" and cfg.draft["aux_layer_ids"] == [1, 2, 3]
    assert abs(cfg.val_fraction - 0.1) < 1e-9 and cfg.schedule == "constant" and cfg.resume == "none"
    assert (cfg.distributed, cfg.log_every, cfg.precision, cfg.muon_adjust_lr) == (
        "fsdp",
        1,
        "fp32",
        "original",
    )
    assert cfg.draft["loss_weighting"] == "exp-decay" and cfg.draft["loss_gamma"] == 4.0
    assert cfg.draft["block_attention"] == "causal" and cfg.warmup_steps == 5 and cfg.prefetch == 8


def test_a_speculators_line_without_speculator_type_trains_eagle3_as_there(
    tmp_path, tiny_store, tiny_model_dir
):
    ours = ["--store", str(tiny_store), "--save-path", str(tmp_path / "r")]
    theirs = translate([*ours, "--verifier-name-or-path", str(tiny_model_dir)], train)
    assert theirs.algorithm == "eagle3" and any("eagle3, speculators' default" in n for n in theirs.notes)
    assert _cfg([*ours, "--verifier-name-or-path", str(tiny_model_dir)]).speculator_type == "eagle3"
    assert (
        _cfg([*ours, "--verifier", str(tiny_model_dir)]).speculator_type == "dflash"
    )  # our spelling: our default
    given = _cfg([*ours, "--verifier-name-or-path", str(tiny_model_dir), "--speculator-type=dspark"])
    assert given.speculator_type == "dspark"


def test_dspark_flags(tmp_path, tiny_store, tiny_model_dir):
    base = ["--store", str(tiny_store), "--verifier-name-or-path", str(tiny_model_dir), "--save-path",
            str(tmp_path / "r")]  # fmt: skip
    cfg = _cfg([*base, "--speculator-type", "dspark", "--markov-rank", "64", "--markov-head-type", "gated",
                "--no-enable-confidence-head", "--loss-fn", '{"ce": 0.1, "tv": 1.8}', "--no-sample-from-anchor",
                "--confidence-head-alpha", "0.5", "--draft-arch", "qwen3"])  # fmt: skip
    assert cfg.speculator_type == "dspark"
    assert {k: cfg.draft[k] for k in ("markov_rank", "markov_head_type", "enable_confidence_head", "loss_mix",
                                      "sample_from_anchor", "confidence_head_alpha")} == {
        "markov_rank": 64, "markov_head_type": "gated", "enable_confidence_head": False,
        "loss_mix": {"ce": 0.1, "tv": 1.8}, "sample_from_anchor": False, "confidence_head_alpha": 0.5,
    }  # fmt: skip
    for argv, needle in ((["--markov-rank", "8"], "--markov-rank: an option of dspark; give --speculator-type"),
                         (["--sample-from-anchor"], "--sample-from-anchor: spectrain's DFlash never predicts"),
                         (["--speculator-type", "dspark", "--loss-fn", "jsd"], "--loss-fn jsd: spectrain's dspark "
                          "mixes ce, kl_div, tv")):  # fmt: skip
        with pytest.raises(click.UsageError, match=re.escape(needle)):
            translate([*base, *argv], train)


def test_online_flags_of_its_examples(tmp_path, tiny_model_dir, sample_chats_path):
    argv = ["--verifier-name-or-path", str(tiny_model_dir), "--data-path", str(sample_chats_path),
            "--vllm-endpoint", "http://127.0.0.1:9/v1", "--on-missing", "generate", "--on-generate", "delete",
            "--request-timeout", "30", "--max-retries", "5", "--save-path", str(tmp_path / "r")]  # fmt: skip
    cfg = _cfg(argv)
    assert cfg.online and cfg.delete_consumed and cfg.prompts == str(sample_chats_path)
    assert cfg.online_options["client_options"] == {"request_timeout_s": 30.0, "max_retries": 5}
    offline = _cfg([*argv[:-2], "--on-missing", "raise", "--store", str(tmp_path / "s"), "--save-path", "x"])
    assert not offline.online and offline.endpoints == []


def test_a_speculators_run_yaml_is_read_flag_by_flag(tmp_path, tiny_store, tiny_model_dir):
    (tmp_path / "run.yaml").write_text(
        f"train:\n  speculator_type: dflash\n  seed: 7\n  verifier:\n    verifier_name_or_path: {tiny_model_dir}\n"
        "  trainer:\n    epochs: 3\n    save_path: " + str(tmp_path / "r") + "\n  optimizer:\n    lr: 0.002\n"
        "  dflash:\n    block_size: 8\n  draft:\n    target_layer_ids: [1, 2, 3]\n"
    )
    cfg = _cfg(["--config", str(tmp_path / "run.yaml"), "--store", str(tiny_store), "--epochs", "2"])
    assert (cfg.seed, cfg.epochs, cfg.lr, cfg.draft["block_size"]) == (7, 2, 0.002, 8)  # flags over the file
    assert cfg.draft["aux_layer_ids"] == [1, 2, 3] and cfg.verifier == str(tiny_model_dir)


def test_docs_hold_the_table():
    assert markdown_table() in (ROOT / "docs/train.md").read_text()


def test_dry_run_prints_the_plan_and_writes_nothing(tmp_path, tiny_store, tiny_model_dir):
    argv = ["train", "--store", str(tiny_store), "--verifier", str(tiny_model_dir), "--save-path",
            str(tmp_path / "r"), "--block-size", "4", "--num-layers", "1", "--max-anchors", "16",
            "--total-seq-len", "256", "--epochs", "2", "--max-steps", "500", "--dry-run"]  # fmt: skip
    from spectrain.cli import main

    res = CliRunner().invoke(main, argv)
    assert res.exit_code == 0, res.output
    plan = json.loads(res.stdout.strip().splitlines()[-1])
    data, step = plan["data"], plan["step"]
    assert data["samples_per_epoch"] > 40 and data["tokens_per_epoch"] > 1000
    assert 0 < data["steps"] < 500 and "beyond the data" in data["note"]
    assert step["flops"] > 1e6 and step["peak_bytes"] > 1e5 and step["peak_gib_by_kind"]
    assert not (tmp_path / "r").exists()
