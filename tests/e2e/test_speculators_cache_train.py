"""``spectrain train --hidden-states-path DIR`` trains from a cache speculators' own
generate-offline-data wrote: imported into ``DIR.store`` on the first run, reused after, a changed
file refused; ``--on-missing`` as speculators means it."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from _speculators import LAYERS, prepared_dataset, speculators_generate
from click.testing import CliRunner

from hsgen.serve.testing import running_server

ROWS = 20
SIZES = ["--speculator-type", "dflash", "--block-size", "4", "--num-layers", "1", "--max-anchors", "16", "--total-seq-len", "512",
         "--target-layer-ids", "1", "2", "3", "--max-steps", "2", "--train-data-ratio", "0.9"]  # fmt: skip


@pytest.fixture(scope="module")
def cache(tmp_path_factory, tiny_model_dir, sample_chats_path):
    """A prepared dataset of ROWS rows and its speculators cache (``hidden_states/``), with the server
    that wrote it still running (its shared directory is the cache's, as launch_vllm.py
    --hidden-states-path sets it)."""
    root = tmp_path_factory.mktemp("speculators-cache")
    data = root / "output"
    rows = prepared_dataset(data, tiny_model_dir, sample_chats_path, ROWS)
    with running_server(tiny_model_dir, LAYERS, data / "hidden_states", dtype="float32") as url:
        speculators_generate(url, data)
        yield data, rows, url


def _copy(cache, tmp_path, drop=()):
    """A copy of the dataset and its cache without the files of rows ``drop``."""
    data = tmp_path / "output"
    shutil.copytree(cache[0], data)
    for row in drop:
        (data / "hidden_states" / f"hs_{row}.safetensors").unlink()
    return data


def _train(data, model, save, *extra):
    from spectrain.cli import main

    argv = ["train", "--verifier-name-or-path", str(model), "--data-path", str(data), "--hidden-states-path",
            str(data / "hidden_states"), "--save-path", str(save), *SIZES, *extra]  # fmt: skip
    return CliRunner().invoke(main, argv)


def _summary(res):
    assert res.exit_code in (0, 3), res.output
    return json.loads(res.stdout.strip().splitlines()[-1])


def test_on_missing_raise_refuses_before_anything_then_warn_trains_the_rest(cache, tmp_path, tiny_model_dir):
    data = _copy(cache, tmp_path, drop=(3, 11))
    res = _train(data, tiny_model_dir, tmp_path / "r", "--on-missing", "raise")
    assert res.exit_code == 1
    line = res.output.strip().splitlines()[-1]
    assert "no hidden-state file for 2 of its 20 rows (rows 3, 11)" in line and "--on-missing warn" in line
    assert not (tmp_path / "r").exists()

    plan = _train(data, tiny_model_dir, tmp_path / "r", "--on-missing", "warn", "--dry-run")
    planned = _summary(plan)["data"]
    assert planned["speculators_cache"]["rows_without_file"] == 2 and planned["store"].endswith(
        "hidden_states.store"
    )

    res = _train(data, tiny_model_dir, tmp_path / "r", "--on-missing", "warn")
    summary = _summary(res)
    assert res.exit_code == 0 and summary["step"] == 2
    assert summary["speculators_cache"]["rows_without_file"] == 2
    from hsgen.store import HiddenStateStore

    store = HiddenStateStore.open(data / "hidden_states.store")
    assert len(store.sample_ids()) == ROWS - 2 and store.header.layer_ids == tuple(LAYERS)


def test_the_store_is_reused_and_a_changed_file_refused(cache, tmp_path, tiny_model_dir):
    data = _copy(cache, tmp_path)
    first = _summary(_train(data, tiny_model_dir, tmp_path / "a", "--on-missing", "raise"))
    assert first["speculators_cache"]["imported"] == ROWS
    again = _summary(_train(data, tiny_model_dir, tmp_path / "b"))  # offline: --on-missing raise by default
    assert (
        again["speculators_cache"]["imported"] == 0 and again["speculators_cache"]["already_stored"] == ROWS
    )

    from safetensors.numpy import load_file, save_file

    path = data / "hidden_states" / "hs_5.safetensors"
    arrays = load_file(str(path))
    save_file({**arrays, "hidden_states": arrays["hidden_states"] * np.float32(0.5)}, str(path))
    res = _train(data, tiny_model_dir, tmp_path / "c")
    assert res.exit_code == 1 and "hs_5.safetensors: changed since it was imported" in res.output

    save_file(arrays, str(path))  # the same states again under a new mtime: accepted, recorded
    assert (
        _summary(_train(data, tiny_model_dir, tmp_path / "d"))["speculators_cache"]["already_stored"] == ROWS
    )


def test_a_file_that_cannot_be_used_is_lost_data_under_warn(cache, tmp_path, tiny_model_dir):
    data = _copy(cache, tmp_path)
    path = data / "hidden_states" / "hs_7.safetensors"
    path.write_bytes(path.read_bytes()[:200])
    res = _train(data, tiny_model_dir, tmp_path / "r")
    assert res.exit_code == 1 and "hs_7.safetensors" in res.output.strip().splitlines()[-1]
    res = _train(data, tiny_model_dir, tmp_path / "r", "--on-missing", "warn")
    assert res.exit_code == 3 and _summary(res)["samples_refused"] == 1  # a run that lost data exits non-zero
    res = _train(data, tiny_model_dir, tmp_path / "r2", "--on-missing", "warn", "--accept-refused", "1")
    assert res.exit_code == 0


def test_online_the_cache_is_read_and_the_missing_rows_generated(cache, tmp_path, tiny_model_dir):
    data = _copy(cache, tmp_path, drop=(0, 1, 2))
    url, served = cache[2], cache[0] / "hidden_states"  # the server writes into the original cache directory
    res = _train(data, tiny_model_dir, tmp_path / "r", "--vllm-endpoint", f"{url}/v1", "--on-missing", "generate",
                 "--shared-dir", str(served), "--max-steps", "50", "--epochs", "1", "--train-data-ratio", "1.0")  # fmt: skip
    summary = _summary(res)
    assert res.exit_code == 0, res.output
    assert summary["speculators_cache"]["imported"] == ROWS - 3
    assert summary["data"]["samples_generated"] == 3  # only the rows without a file came from the server
