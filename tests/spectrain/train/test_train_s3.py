"""Training from a store on object storage (``s3://``, a real S3-compatible server the tests
start) reads the same samples as from disk and trains the same steps."""

from __future__ import annotations

import numpy as np
import torch
from _train_util import small_config

from hsgen.store import HiddenStateStore
from spectrain.data.sources import StoreSource
from spectrain.train.loop import train


def _copy_to(src: HiddenStateStore, url: str) -> HiddenStateStore:
    dst = HiddenStateStore.create(url, src.header)
    with dst.writer(shard_bytes=256 << 10) as w:
        for s in src:
            w.add(s.sample_id, s.hidden_states, s.token_ids, s.loss_mask)
    return HiddenStateStore.open(url)


def test_train_from_s3_matches_the_local_store(tiny_store, tiny_model_dir, tmp_path, s3_url):
    torch.set_num_threads(1)
    local = HiddenStateStore.open(tiny_store)
    remote = _copy_to(local, s3_url)
    assert remote.verify() == [] and len(remote) == len(local)
    src = StoreSource(s3_url, val_fraction=0.0, seed=1)
    assert src.path == s3_url and src.plan(0) == StoreSource(tiny_store, val_fraction=0.0, seed=1).plan(0)
    runs = {}
    for name, store in (("local", tiny_store), ("s3", s3_url)):
        runs[name] = train(small_config(store, tiny_model_dir, tmp_path / name, max_steps=3, read_threads=8))
    assert runs["s3"]["step"] == runs["local"]["step"] == 3
    assert runs["s3"].get("samples_refused", 0) == 0
    np.testing.assert_allclose(runs["s3"]["loss"], runs["local"]["loss"], rtol=1e-5)
