"""Offline training checks the store against the verifier: tokenizer, vocabulary, layer ids.

Issue 13, point 5.
"""

from __future__ import annotations

import dataclasses

import pytest
from _train_util import small_config
from click.testing import CliRunner

from hsgen.store import HiddenStateStore
from spectrain.train.loop import train


def _copy(src, dst, *, token_shift: int = 0, **header_changes) -> HiddenStateStore:
    old = HiddenStateStore.open(src)
    new = HiddenStateStore.create(dst, dataclasses.replace(old.header, **header_changes))
    with new.writer("copy") as w:
        for sid in old.sample_ids():
            s = old.read(sid)
            w.add(sid, s.hidden_states, s.token_ids + token_shift, s.loss_mask)
    return new


def test_store_of_another_tokenizer_is_refused(tiny_store, tiny_model_dir, tmp_path):
    store = _copy(tiny_store, tmp_path / "other", tokenizer_fingerprint="ab" * 32)
    with pytest.raises(ValueError, match="another tokenizer or chat template"):
        train(small_config(store.path, tiny_model_dir, tmp_path / "run", max_steps=2))
    assert not list((tmp_path / "run").glob("checkpoint-*"))


def test_store_rendered_with_the_verifiers_tokenizer_trains(tiny_store, tiny_model_dir, tmp_path):
    from hsgen.inputs.render import ChatRenderer, RenderConfig

    fp = ChatRenderer(RenderConfig(tokenizer_path=str(tiny_model_dir))).fingerprint
    store = _copy(tiny_store, tmp_path / "same", tokenizer_fingerprint=fp)
    assert train(small_config(store.path, tiny_model_dir, tmp_path / "run", max_steps=2))["step"] == 2


def test_token_ids_beyond_the_vocabulary_are_one_clear_error(tiny_store, tiny_model_dir, tmp_path):
    from spectrain.cli import main

    store = _copy(tiny_store, tmp_path / "big", token_shift=100_000)
    args = ["train", "--store", str(store.path), "--verifier", str(tiny_model_dir), "--save-path",
            str(tmp_path / "run"), "--total-seq-len", "256", "--block-size", "4", "--max-anchors", "16",
            "--num-layers", "1", "--val-fraction", "0", "--max-steps", "2"]  # fmt: skip
    res = CliRunner().invoke(main, args)
    assert res.exit_code == 1
    assert "beyond the verifier's vocabulary" in res.output and "another tokenizer" in res.output
    assert res.exception is None or isinstance(res.exception, SystemExit)


def test_layer_ids_beyond_the_verifier_are_refused(tiny_store, tiny_model_dir, tmp_path):
    store = _copy(tiny_store, tmp_path / "deep", layer_ids=(1, 2, 3, 99))
    with pytest.raises(ValueError, match=r"include \[99\], beyond the verifier's 4 layers"):
        train(
            small_config(
                store.path, tiny_model_dir, tmp_path / "run", draft={"block_size": 4, "num_layers": 1}
            )
        )


def test_generate_checks_layer_ids_against_the_models_config(tmp_path, tiny_model_dir):
    from hsgen.cli.generate import generate as gen_cmd

    data = tmp_path / "d.jsonl"
    data.write_text('{"input_ids": [1, 2, 3]}\n')
    res = CliRunner().invoke(
        gen_cmd,
        [str(data), "--store", str(tmp_path / "st"), "--endpoint", "http://127.0.0.1:9", "--layer-ids",
         "1,2,3,99", "--tokenizer", str(tiny_model_dir)],
    )  # fmt: skip
    assert res.exit_code == 2 and "layer id 99 exceeds the model's 4 layers" in res.output
    assert not (tmp_path / "st").exists()


def test_training_on_nothing_is_an_error_and_an_empty_validation_split_warns(
    tiny_store, tiny_model_dir, tmp_path, caplog
):
    from spectrain.cli import main

    empty = HiddenStateStore.create(tmp_path / "empty", HiddenStateStore.open(tiny_store).header)
    args = ["train", "--store", str(empty.path), "--verifier", str(tiny_model_dir), "--save-path",
            str(tmp_path / "run"), "--total-seq-len", "256", "--block-size", "4", "--max-anchors", "16",
            "--num-layers", "1", "--max-steps", "2"]  # fmt: skip
    res = CliRunner().invoke(main, args)
    assert res.exit_code == 1 and "nothing to train on" in res.output
    assert not list((tmp_path / "run").glob("checkpoint-*"))
    few = tmp_path / "few"
    old = HiddenStateStore.open(tiny_store)
    ids = sorted(old.sample_ids())[:3]
    with HiddenStateStore.create(few, old.header).writer("w") as w:
        for s in old.read_many(ids):
            w.add(s.sample_id, s.hidden_states, s.token_ids, s.loss_mask)
    summary = train(small_config(few, tiny_model_dir, tmp_path / "run2", val_fraction=0.01))
    assert summary["step"] >= 1
    assert "the validation split (--val-fraction 0.01) is empty" in caplog.text
