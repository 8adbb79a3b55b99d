"""A hidden-state cache written by speculators' own generate-offline-data code against ``hsgen
serve`` imports into a store (``hsgen import-speculators``) that trains and holds exactly the
server's states."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
from _speculators import LAYERS, prepared_dataset, speculators_generate

from hsgen.serve.testing import running_server


def _import(*args):
    return subprocess.run([sys.executable, "-m", "hsgen.cli", "import-speculators", *map(str, args),
                           "--no-progress"], capture_output=True, text=True, timeout=300)  # fmt: skip


def test_a_cache_speculators_writes_imports_and_trains(tmp_path, tiny_model_dir, sample_chats_path):
    data = tmp_path / "output"
    rows = prepared_dataset(data, tiny_model_dir, sample_chats_path, 24)
    with running_server(tiny_model_dir, LAYERS, tmp_path / "shm", dtype="float32") as url:
        speculators_generate(url, data)
    files = sorted((data / "hidden_states").glob("hs_*.safetensors"))
    assert len(files) == 24  # speculators' own writer made the cache

    store = tmp_path / "store"
    r = _import(data, "--store", store, "--verifier", tiny_model_dir, "--layer-ids", "1,2,3,4")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout.splitlines()[-1])["imported"] == 24

    from safetensors.numpy import load_file

    from hsgen.inputs.formats import content_id
    from hsgen.store import HiddenStateStore

    st = HiddenStateStore.open(store)
    assert st.header.layer_ids == tuple(LAYERS) and len(st.sample_ids()) == 24
    i = 5
    sid = content_id({"input_ids": rows["input_ids"][i], "loss_mask": rows["loss_mask"][i]})
    sample = st.read(sid)
    raw = load_file(str(data / "hidden_states" / f"hs_{i}.safetensors"))
    np.testing.assert_array_equal(sample.token_ids, raw["token_ids"])
    np.testing.assert_array_equal(np.asarray(sample.hidden_states, np.float32), raw["hidden_states"])
    np.testing.assert_array_equal(sample.loss_mask, np.asarray(rows["loss_mask"][i], np.uint8))

    r = _import(data, "--store", store, "--verifier", tiny_model_dir, "--layer-ids", "1,2,3,4")  # idempotent
    assert r.returncode == 0 and json.loads(r.stdout.splitlines()[-1])["already_stored"] == 24

    files[3].write_bytes(files[3].read_bytes()[:100])  # a truncated file is named, the rest kept, exit 1
    r = _import(data, "--store", tmp_path / "store2", "--verifier", tiny_model_dir, "--layer-ids", "1,2,3,4")
    assert r.returncode == 1 and files[3].name in r.stderr
    assert json.loads(r.stdout.splitlines()[-1])["imported"] == 23

    from spectrain.train.loop import TrainConfig, train

    summary = train(TrainConfig(store=str(store), verifier=str(tiny_model_dir), save_path=str(tmp_path / "run"),
                                draft={"block_size": 4, "max_anchors": 16, "num_layers": 1}, total_seq_len=256,
                                max_steps=3, log_every=1, val_fraction=0.0, save_every=0))  # fmt: skip
    assert summary["step"] == 3 and np.isfinite(summary["loss"])
