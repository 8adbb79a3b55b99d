"""Stores of target ids (``targets = "argmax"``, format version 3) and stores of today's format."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from hsgen.store import HiddenStateStore, StoreError, StoreHeader
from hsgen.store.errors import CorruptSample, StoreHeaderMismatch

FIXTURE = Path(__file__).parents[2] / "data" / "store-format-v2"
"""A store written by hsgen before target ids existed (format version 2, final-layer states)."""


def _argmax_header(**kw) -> StoreHeader:
    return StoreHeader("v", (1, 2), 8, "float32", targets="argmax", **kw)


def _fill(store: HiddenStateStore, n: int = 4, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    targets = {}
    with store.writer("w") as w:
        for i in range(n):
            T = 3 + i
            hidden = rng.standard_normal((T, 2, 8)).astype(np.float32)
            targets[f"s{i}"] = rng.integers(0, 50_000, T).astype(np.int32)
            w.add(f"s{i}", hidden, rng.integers(0, 100, T), np.ones(T, np.uint8), target_ids=targets[f"s{i}"])
    return targets


def test_argmax_store_is_version_3_and_round_trips_target_ids(tmp_path):
    store = HiddenStateStore.create(tmp_path / "s", _argmax_header())
    assert store.header.format_version == 3
    doc = json.loads((tmp_path / "s" / "hsgen-store.json").read_text())
    assert doc["format_version"] == 3 and doc["header"]["targets"] == "argmax"
    assert store.header.aux_layer_ids == (1, 2)  # every stored layer is a draft input
    targets = _fill(store)
    store = HiddenStateStore.open(tmp_path / "s")
    for sid, want in targets.items():
        got = store.read(sid)
        assert got.target_ids.dtype == np.int32
        np.testing.assert_array_equal(got.target_ids, want)
        T = len(want)
        hidden, ids, mask = np.empty((T, 2, 8), np.float32), np.empty(T, np.int64), np.empty(T, np.uint8)
        out = np.full(T, -1, np.int32)
        store.read_into(sid, hidden, ids, mask, verify=True, target_ids=out)
        np.testing.assert_array_equal(out, want)
        np.testing.assert_array_equal(hidden, got.hidden_states)
    assert store.verify() == []


def test_checksum_covers_the_target_ids(tmp_path):
    store = HiddenStateStore.create(tmp_path / "s", _argmax_header())
    _fill(store, n=2)
    store = HiddenStateStore.open(tmp_path / "s")
    rec = store.record("s1")
    chunk = tmp_path / "s" / rec.shard / "target_ids" / "c" / "0"
    raw = bytearray(chunk.read_bytes())
    raw[rec.offset * 4] ^= 0x01  # one bit of s1's first target id
    chunk.write_bytes(bytes(raw))
    store = HiddenStateStore.open(tmp_path / "s")
    with pytest.raises(CorruptSample, match="s1"):
        store.read("s1")
    problems = store.verify()
    assert len(problems) == 1 and "'s1'" in problems[0] and "checksum" in problems[0]
    store.read("s0")  # the other sample is intact


def test_writer_refuses_missing_or_unexpected_target_ids(tmp_path):
    argmax = HiddenStateStore.create(tmp_path / "a", _argmax_header())
    hidden = np.zeros((3, 2, 8), np.float32)
    with argmax.writer("w") as w:
        with pytest.raises(ValueError, match="pass target_ids"):
            w.add("x", hidden, [1, 2, 3])
        with pytest.raises(ValueError, match=r"target_ids must be \[3\] integers"):
            w.add("x", hidden, [1, 2, 3], target_ids=[1, 2])
        with pytest.raises(ValueError, match="token ids in"):
            w.add("x", hidden, [1, 2, 3], target_ids=[1, -2, 3])
    states = HiddenStateStore.create(tmp_path / "b", StoreHeader("v", (1, 2), 8, "float32"))
    with states.writer("w") as w, pytest.raises(ValueError, match="keeps final-layer states"):
        w.add("x", hidden, [1, 2, 3], target_ids=[1, 2, 3])


def test_targets_are_part_of_the_data_meaning(tmp_path):
    HiddenStateStore.create(tmp_path / "s", StoreHeader("v", (1, 2), 8, "float32"))
    with pytest.raises(StoreHeaderMismatch, match="targets: store has 'states', got 'argmax'"):
        HiddenStateStore.create(tmp_path / "s", _argmax_header())
    with pytest.raises(ValueError, match="need format version >= 3"):
        _argmax_header(format_version=2)
    with pytest.raises(ValueError, match="targets must be one of"):
        StoreHeader("v", (1, 2), 8, "float32", targets="topk")


def test_a_states_store_is_still_written_at_version_2(tmp_path):
    """A store without target ids keeps today's header byte for byte: hsgen that knows only
    version 2 still opens it."""
    HiddenStateStore.create(tmp_path / "s", StoreHeader("v", (1, 2), 8, "float32"))
    doc = json.loads((tmp_path / "s" / "hsgen-store.json").read_text())
    assert doc["format_version"] == 2 and doc["header"]["format_version"] == 2
    assert "targets" not in doc["header"]


def test_a_store_written_before_target_ids_opens_reads_and_verifies(tmp_path):
    path = tmp_path / "old"
    shutil.copytree(FIXTURE, path)
    store = HiddenStateStore.open(path)
    assert store.header.targets == "states" and store.header.format_version == 2
    assert store.header.aux_layer_ids == (1, 2, 3)
    assert len(store) == 6 and store.verify() == []
    sample = store.read("v2-00")
    assert sample.target_ids is None and sample.hidden_states.shape[1:] == (4, 64)
    # and it takes more samples from today's writer, still verifiable
    with store.writer("new") as w:
        w.add("extra", sample.hidden_states, sample.token_ids, sample.loss_mask)
    store = HiddenStateStore.open(path)
    assert len(store) == 7 and store.verify() == []


def test_a_newer_format_version_is_refused_in_one_line(tmp_path):
    store_dir = tmp_path / "s"
    HiddenStateStore.create(store_dir, _argmax_header())
    doc = json.loads((store_dir / "hsgen-store.json").read_text())
    doc["header"]["format_version"] = 4
    (store_dir / "hsgen-store.json").write_text(json.dumps(doc))
    with pytest.raises(StoreError, match="format version 4 is newer than this hsgen reads"):
        HiddenStateStore.open(store_dir)
