"""A hidden-state cache written by speculators' own generate-offline-data code against ``hsgen
serve`` imports into a store (``hsgen import-speculators``) that trains and holds exactly the
server's states."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import numpy as np
import pytest

from hsgen.serve.testing import running_server

LAYERS = [1, 2, 3, 4]


def _prepared_dataset(path, model_dir, sample_chats_path, n: int):
    """The columns speculators' prepare-data writes (input_ids, loss_mask, seq_len; torch format)."""
    import datasets

    from hsgen.render import ChatRenderer, RenderConfig

    renderer = ChatRenderer(RenderConfig(tokenizer_path=str(model_dir), max_len=160))
    rows = {"input_ids": [], "loss_mask": [], "seq_len": []}
    for line in sample_chats_path.read_text().splitlines()[:n]:
        ids, mask = renderer.render_messages(json.loads(line)["messages"])
        rows["input_ids"].append(list(ids[:160]))
        rows["loss_mask"].append(list(mask[:160]))
        rows["seq_len"].append(min(len(ids), 160))
    datasets.Dataset.from_dict(rows).with_format("torch").save_to_disk(str(path))
    return rows


def _import(*args):
    return subprocess.run([sys.executable, "-m", "hsgen.cli", "import-speculators", *map(str, args),
                           "--no-progress"], capture_output=True, text=True, timeout=300)  # fmt: skip


def test_a_cache_speculators_writes_imports_and_trains(tmp_path, tiny_model_dir, sample_chats_path):
    offline = pytest.importorskip("speculators.cli.generate_offline_data",
                                  reason="scripts/install.sh installs speculators 0.9.0")  # fmt: skip
    data = tmp_path / "output"
    rows = _prepared_dataset(data, tiny_model_dir, sample_chats_path, 24)
    with running_server(tiny_model_dir, LAYERS, tmp_path / "shm", dtype="float32") as url:
        asyncio.run(offline._generate_and_save_hidden_states(
            model=None, endpoint=f"{url}/v1", preprocessed_data=str(data), output=None, max_samples=None,
            concurrency=4, validate_outputs=True, request_timeout=600, max_retries=1, fail_on_error=True,
            max_consecutive_errors=None, world_size=1, rank=0))  # fmt: skip
    files = sorted((data / "hidden_states").glob("hs_*.safetensors"))
    assert len(files) == 24  # speculators' own writer made the cache

    store = tmp_path / "store"
    r = _import(data, "--store", store, "--verifier", tiny_model_dir, "--layer-ids", "1,2,3,4")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout.splitlines()[-1])["imported"] == 24

    from safetensors.numpy import load_file

    from hsgen.inputs import content_id
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

    from spectrain.train import TrainConfig, train

    summary = train(TrainConfig(store=str(store), verifier=str(tiny_model_dir), save_path=str(tmp_path / "run"),
                                draft={"block_size": 4, "max_anchors": 16, "num_layers": 1}, total_seq_len=256,
                                max_steps=3, log_every=1, val_fraction=0.0, save_every=0))  # fmt: skip
    assert summary["step"] == 3 and np.isfinite(summary["loss"])
