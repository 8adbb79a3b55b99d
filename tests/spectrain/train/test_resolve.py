"""Config resolution outside the CLI: flags over a config file over defaults, errors naming the flag."""

from __future__ import annotations

import json

import pytest

from spectrain.train.resolve import DEFAULT_SAVE_PATH, ConfigError, resolve_train_config


def test_flags_win_over_the_file_and_defaults_fill_the_rest(tmp_path):
    conf = tmp_path / "run.json"
    conf.write_text(json.dumps({"store": "s", "verifier": str(tmp_path), "lr": 1e-3, "epochs": 2,
                                "draft": {"max_anchors": 64}}))  # fmt: skip
    cfg = resolve_train_config({"config": str(conf), "lr": 2e-3, "block_size": 4, "train_region": "greedy",
                                "draft_option": ["max_anchors=32", "loss-gamma=7"]})  # fmt: skip
    assert (cfg.lr, cfg.epochs, cfg.save_path) == (2e-3, 2, DEFAULT_SAVE_PATH)
    assert cfg.draft["block_size"] == 4 and cfg.draft["max_anchors"] == 32 and cfg.draft["loss_gamma"] == 7
    assert cfg.draft["train_region"] == "greedy"


@pytest.mark.parametrize(
    ("params", "flag"),
    [
        ({"draft_option": ["no-equals-sign"]}, "--draft-option"),
        ({"online_option": ["nothing"]}, "--online-option"),
        ({"template_kwargs": "{not json"}, "--template-kwargs"),
        ({"template_kwargs": "[1, 2]"}, "--template-kwargs"),
        ({"layer_ids": "a,b"}, "--layer-ids"),
        ({"save_every": 5, "save_every_epochs": 1}, None),
    ],
)
def test_a_flag_it_cannot_take_is_named(params, flag, tmp_path):
    with pytest.raises(ConfigError) as e:
        resolve_train_config({"store": "s", "verifier": str(tmp_path), **params})
    assert e.value.param_hint == flag
