"""What the training loop reads: a damaged sample is skipped, never trained or exported."""

from __future__ import annotations

import shutil

import numpy as np
import torch
from safetensors.torch import load_file

from spectrain.data.sources import StoreSource
from spectrain.train.loop import TrainConfig, train


def test_training_skips_a_nan_filled_sample_and_exports_finite_weights(
    tiny_store, tiny_model_dir, tmp_path, caplog
):
    from hsgen.store import HiddenStateStore

    torch.set_num_threads(1)
    path = tmp_path / "store"
    shutil.copytree(tiny_store, path)
    store = HiddenStateStore.open(path)
    sid = StoreSource(path, val_fraction=0.0, seed=1).plan(0)[0]  # in the first step
    rec = store.record(sid)
    row = store.header.num_layers * store.header.hidden_size * 2
    with open(path / rec.shard / "hidden_states/c/0/0/0", "r+b") as f:
        f.seek(rec.offset * row)
        f.write(np.full(rec.length * row // 2, 0x7FC0, np.uint16).tobytes())  # every value NaN
    cfg = TrainConfig(
        store=str(path), verifier=str(tiny_model_dir), save_path=str(tmp_path / "run"), speculator_type="dflash",
        draft={"block_size": 4, "max_anchors": 16, "num_layers": 1}, total_seq_len=256, epochs=1, max_steps=3,
        lr=3e-3, save_every=0, log_every=1, val_fraction=0.0, seed=1, warmup_steps=1,
    )  # fmt: skip
    summary = train(cfg)
    assert summary["loss"] is not None and np.isfinite(summary["loss"])
    assert summary["samples_refused"] == 1
    weights = load_file(str(tmp_path / "run" / summary["checkpoint"].split("/")[-1] / "model.safetensors"))
    assert all(torch.isfinite(w.float()).all() for w in weights.values())
    assert any(repr(sid) in r.message and "checksum" in r.message for r in caplog.records)
