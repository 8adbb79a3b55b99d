"""Core behaviour of hsgen.store: round trips, headers, validation, deletes, gc, verify."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import zarr

from hsgen.store import (
    HiddenStateStore,
    Sample,
    SampleRecord,
    StoreError,
    StoreHeader,
    StoreHeaderMismatch,
)
from hsgen.store.synthetic import make_sample

HEADER = StoreHeader(verifier="tiny", layer_ids=(1, 2, 3), hidden_size=16, dtype="bfloat16")


def header(**kw) -> StoreHeader:
    return StoreHeader(**{**HEADER.to_dict(), **kw})


def fill(
    store: HiddenStateStore, n: int, *, writer_id=None, seed=0, shard_bytes=4096, prefix="s"
) -> dict[str, Sample]:
    out = {}
    with store.writer(writer_id, shard_bytes=shard_bytes, chunk_bytes=512) as w:
        for i in range(n):
            s = make_sample(store.header, f"{prefix}{i}", 1 + (i * 7919 + seed) % 40, seed)
            w.add(s.sample_id, s.hidden_states, s.token_ids, s.loss_mask)
            out[s.sample_id] = s
    return out


def assert_same(a: Sample, b: Sample) -> None:
    assert a.sample_id == b.sample_id
    assert a.hidden_states.dtype == b.hidden_states.dtype
    np.testing.assert_array_equal(a.hidden_states, b.hidden_states)
    np.testing.assert_array_equal(a.token_ids, b.token_ids)
    np.testing.assert_array_equal(a.loss_mask, b.loss_mask)
    assert a.token_ids.dtype == np.int64 and a.loss_mask.dtype == np.uint8


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("codec", ["raw", "lz4"])
def test_lossless_round_trip(tmp_path, dtype, codec):
    store = HiddenStateStore.create(tmp_path / "s", header(dtype=dtype, codec=codec))
    written = fill(store, 25)
    reopened = HiddenStateStore.open(tmp_path / "s")
    assert len(reopened) == 25 and reopened.sample_ids() == list(written)
    for sid, s in written.items():
        got = reopened.read(sid, verify=True)
        assert_same(got, s)
        assert got.dtype == dtype
    assert [s.sample_id for s in reopened] == list(written)
    assert reopened.verify() == []


def test_bf16_reads_back_as_torch_bfloat16_without_copy(tmp_path):
    torch = pytest.importorskip("torch")
    store = HiddenStateStore.create(tmp_path / "s", HEADER)
    written = fill(store, 3)
    got = store.read("s1")
    t = torch.from_numpy(got.hidden_states).view(torch.bfloat16)
    assert t.data_ptr() == got.hidden_states.ctypes.data
    want = written["s1"].hidden_states.view(ml_dtypes.bfloat16).astype(np.float32)
    np.testing.assert_array_equal(t.float().numpy(), want)


def test_fp8_codec_is_close_and_self_describing(tmp_path):
    store = HiddenStateStore.create(tmp_path / "s", header(codec="fp8"))
    written = fill(store, 12)
    reopened = HiddenStateStore.open(tmp_path / "s")
    assert reopened.header.codec == "fp8"
    for sid, s in written.items():
        got = reopened.read(sid, verify=True)
        assert got.hidden_states.dtype == np.uint16
        want = s.hidden_states.view(ml_dtypes.bfloat16).astype(np.float32)
        have = got.hidden_states.view(ml_dtypes.bfloat16).astype(np.float32)
        scale = np.abs(want).max(axis=-1, keepdims=True) / 448
        assert (np.abs(have - want) <= 0.07 * np.abs(want) + scale / 256).all()
        np.testing.assert_array_equal(got.token_ids, s.token_ids)
    stats = reopened.stats()
    raw = HiddenStateStore.create(tmp_path / "r", HEADER)
    fill(raw, 12)
    assert stats["bytes"] < raw.stats()["bytes"]


def test_shards_are_plain_zarr_v3(tmp_path):
    store = HiddenStateStore.create(tmp_path / "s", HEADER)
    written = fill(store, 10)
    for sid, s in written.items():
        rec = store.record(sid)
        assert isinstance(rec, SampleRecord) and rec.checksum.startswith("xxh3:")
        group = zarr.open_group(tmp_path / "s" / rec.shard, mode="r")
        assert group.metadata.zarr_format == 3
        hs = group["hidden_states"][rec.offset : rec.offset + rec.length]
        np.testing.assert_array_equal(hs, s.hidden_states)
        np.testing.assert_array_equal(group["token_ids"][rec.offset : rec.offset + rec.length], s.token_ids)
        np.testing.assert_array_equal(group["loss_mask"][rec.offset : rec.offset + rec.length], s.loss_mask)
        assert group.attrs["hsgen"]["dtype"] == "bfloat16"


def test_shards_hold_many_whole_samples_and_respect_shard_bytes(tmp_path):
    store = HiddenStateStore.create(tmp_path / "s", HEADER)
    row = HEADER.row_bytes
    with store.writer(shard_bytes=50 * row) as w:
        for i in range(20):
            s = make_sample(HEADER, f"a{i}", 20)
            w.add(s.sample_id, s.hidden_states, s.token_ids)
        big = make_sample(HEADER, "big", 120)
        w.add("big", big.hidden_states, big.token_ids)
    shards = store.shards()
    sizes = {name: sum(store.record(i).length for i in ids) for name, ids in shards.items()}
    assert all(v <= 50 for k, v in sizes.items() if "big" not in shards[k])
    assert max(len(ids) for ids in shards.values()) == 2
    assert [len(ids) for ids in shards.values()].count(1) == 1
    np.testing.assert_array_equal(store.read("big").hidden_states, big.hidden_states)
    assert store.read("big").loss_mask.tolist() == [1] * 120


def test_flush_returns_records_and_pending(tmp_path):
    store = HiddenStateStore.create(tmp_path / "s", HEADER)
    w = store.writer("w1")
    s = make_sample(HEADER, "x", 5)
    w.add("x", s.hidden_states, s.token_ids, s.loss_mask)
    assert w.pending == 1 and "x" not in store
    recs = w.flush()
    assert w.pending == 0 and w.flush() == []
    assert recs == [store.record("x")]
    assert recs[0].shard == "shards/w1/00000001.zarr" and recs[0].offset == 0 and recs[0].length == 5
    w.close()
    w.close()
    with pytest.raises(StoreError, match="closed"):
        w.add("y", s.hidden_states, s.token_ids)


def test_ml_dtypes_bfloat16_input_is_accepted(tmp_path):
    store = HiddenStateStore.create(tmp_path / "s", HEADER)
    s = make_sample(HEADER, "x", 4)
    with store.writer() as w:
        w.add("x", s.hidden_states.view(ml_dtypes.bfloat16), s.token_ids.tolist(), s.loss_mask.astype(bool))
    assert_same(store.read("x"), s)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"hidden": np.zeros((3, 3, 16), np.float32)}, "dtype float32"),
        ({"hidden": np.zeros((3, 2, 16), np.uint16)}, r"shape \(3, 2, 16\) must be \[T>0, 3, 16\]"),
        ({"hidden": np.zeros((0, 3, 16), np.uint16), "tokens": []}, "shape"),
        ({"tokens": [1, 2]}, r"token_ids must be \[3\]"),
        ({"tokens": [1.5, 2.0, 3.0]}, "integers"),
        ({"mask": [1, 0]}, r"loss_mask shape \(2,\)"),
        ({"mask": [1, 2, 0]}, "0 or 1"),
        ({"sid": ""}, "non-empty"),
    ],
)
def test_add_rejects_bad_samples(tmp_path, change, match):
    store = HiddenStateStore.create(tmp_path / "s", HEADER)
    args = {
        "sid": "x",
        "hidden": np.zeros((3, 3, 16), np.uint16),
        "tokens": [1, 2, 3],
        "mask": None,
        **change,
    }
    with store.writer() as w, pytest.raises(ValueError, match=match):
        w.add(args["sid"], args["hidden"], args["tokens"], args["mask"])


def test_duplicate_in_one_writer_is_refused(tmp_path):
    store = HiddenStateStore.create(tmp_path / "s", HEADER)
    s = make_sample(HEADER, "x", 3)
    with store.writer() as w:
        w.add("x", s.hidden_states, s.token_ids)
        with pytest.raises(ValueError, match="already added"):
            w.add("x", s.hidden_states, s.token_ids)


def test_header_mismatch_is_refused_clearly(tmp_path):
    HiddenStateStore.create(tmp_path / "s", HEADER)
    assert HiddenStateStore.create(tmp_path / "s", header()).header == HEADER
    other = header(hidden_size=32, layer_ids=(2, 3, 4), tokenizer_fingerprint="abc")
    with pytest.raises(StoreHeaderMismatch) as e:
        HiddenStateStore.create(tmp_path / "s", other)
    msg = str(e.value)
    assert str(tmp_path / "s") in msg
    assert (
        "hidden_size: store has 16, got 32" in msg and "layer_ids: store has [1, 2, 3], got [2, 3, 4]" in msg
    )
    assert "tokenizer_fingerprint" in msg and len(e.value.problems) == 3
    with pytest.raises(StoreHeaderMismatch, match="codec: store has 'raw', got 'lz4'"):
        HiddenStateStore.create(tmp_path / "s", header(codec="lz4"))
    with pytest.raises(StoreError, match="already exists"):
        HiddenStateStore.create(tmp_path / "s", HEADER, exist_ok=False)
    assert HEADER.compatible_with(header(codec="fp8")) == []


def test_header_validation_and_round_trip():
    assert StoreHeader.from_dict(json.loads(json.dumps(HEADER.to_dict()))) == HEADER
    assert StoreHeader("m", [1, 2], 4, "float16").layer_ids == (1, 2)
    for bad, match in [
        ({"layer_ids": (3, 1)}, "sorted"),
        ({"layer_ids": ()}, "layer_ids"),
        ({"hidden_size": 0}, "hidden_size"),
        ({"dtype": "int8"}, "dtype"),
        ({"codec": "zstd"}, "codec"),
        ({"verifier": ""}, "verifier"),
    ]:
        with pytest.raises(ValueError, match=match):
            header(**bad)
    with pytest.raises(ValueError, match="unknown fields"):
        StoreHeader.from_dict({**HEADER.to_dict(), "extra": 1})


def test_open_refuses_non_stores(tmp_path):
    with pytest.raises(StoreError, match=f"{tmp_path}: not an hsgen store"):
        HiddenStateStore.open(tmp_path)
    (tmp_path / "hsgen-store.json").write_text("{not json")
    with pytest.raises(StoreError, match="unreadable store header"):
        HiddenStateStore.open(tmp_path)
    (tmp_path / "hsgen-store.json").write_text(
        json.dumps({"format": "hsgen-store", "header": {**HEADER.to_dict(), "format_version": 99}})
    )
    with pytest.raises(StoreError, match="newer"):
        HiddenStateStore.open(tmp_path)
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    with pytest.raises(StoreError, match="not empty and not an hsgen store"):
        HiddenStateStore.create(other, HEADER)


def test_read_errors_and_read_many_order(tmp_path):
    store = HiddenStateStore.create(tmp_path / "s", HEADER)
    written = fill(store, 30)
    with pytest.raises(KeyError, match="'nope' is not in store"):
        store.read("nope")
    ids = ["s29", "s0", "s15", "s3", "s3"]
    for got, sid in zip(store.read_many(ids), ids, strict=True):
        assert_same(got, written[sid])
    assert store["s7"].sample_id == "s7" and "s7" in store and "zz" not in store


def test_delete_shard_is_recorded_idempotent_and_replayed(tmp_path):
    store = HiddenStateStore.create(tmp_path / "s", HEADER)
    written = fill(store, 20)
    shards = store.shards()
    victim, ids = next(iter(shards.items()))
    store.delete_shard(victim)
    store.delete_shard(victim)
    assert not (tmp_path / "s" / victim).exists()
    assert all(i not in store for i in ids) and len(store) == 20 - len(ids)
    reopened = HiddenStateStore.open(tmp_path / "s")
    assert reopened.sample_ids() == [i for i in written if i not in ids]
    assert reopened.stats()["deleted_shards"] == 1 and reopened.verify() == []
    with pytest.raises(KeyError, match="never committed"):
        store.delete_shard("shards/x/00000001.zarr")
    # Re-adding the deleted samples under a new writer makes them live again, once.
    with reopened.writer() as w:
        for i in ids:
            w.add(i, written[i].hidden_states, written[i].token_ids, written[i].loss_mask)
    assert len(HiddenStateStore.open(tmp_path / "s")) == 20


def test_torn_last_manifest_line_is_ignored_and_dropped_on_resume(tmp_path):
    store = HiddenStateStore.create(tmp_path / "s", HEADER)
    fill(store, 5, writer_id="w1")
    manifest = tmp_path / "s" / "manifests" / "w1.jsonl"
    intact = manifest.read_bytes()
    with open(manifest, "ab") as f:
        f.write(b'{"op":"add","id":"torn","shard":"shards/w1/000')
    reopened = HiddenStateStore.open(tmp_path / "s")
    assert len(reopened) == 5 and reopened.verify() == []
    fill(reopened, 3, writer_id="w1", prefix="t")
    assert manifest.read_bytes().startswith(intact)
    assert b"torn" not in manifest.read_bytes()
    final = HiddenStateStore.open(tmp_path / "s")
    assert len(final) == 8 and final.verify() == []


def test_uncommitted_adds_without_commit_line_are_ignored(tmp_path):
    store = HiddenStateStore.create(tmp_path / "s", HEADER)
    fill(store, 4, writer_id="w1")
    manifest = tmp_path / "s" / "manifests" / "w1.jsonl"
    lines = manifest.read_bytes().splitlines(keepends=True)
    manifest.write_bytes(b"".join(lines[:-1]))
    assert len(HiddenStateStore.open(tmp_path / "s")) < 4


def test_duplicate_ids_resolve_deterministically(tmp_path):
    store = HiddenStateStore.create(tmp_path / "s", HEADER)
    a = make_sample(HEADER, "x", 3, seed=1)
    b = make_sample(HEADER, "x", 4, seed=2)
    for wid, s in [("wb", b), ("wa", a)]:
        with store.writer(wid) as w:
            w.add("x", s.hidden_states, s.token_ids)
    for st in (store, HiddenStateStore.open(tmp_path / "s")):
        assert len(st) == 1 and st.record("x").shard.startswith("shards/wa/")
        assert st.stats()["duplicates"] == 1


def test_verify_reports_corruption(tmp_path):
    store = HiddenStateStore.create(tmp_path / "s", HEADER)
    fill(store, 10)
    rec = store.record("s4")
    data = tmp_path / "s" / rec.shard / "hidden_states" / "c" / "0" / "0" / "0"
    with open(data, "r+b") as f:
        f.seek(rec.offset * HEADER.row_bytes + 3)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    problems = store.verify()
    assert len(problems) == 1 and "'s4'" in problems[0] and "checksum" in problems[0]
    with pytest.raises(StoreError, match="checksum"):
        store.read("s4", verify=True)
    other = store.record("s9")
    (tmp_path / "s" / other.shard / "token_ids" / "c" / "0").unlink()
    assert any("token_ids" in p and "missing" in p for p in HiddenStateStore.open(tmp_path / "s").verify())


def test_gc_removes_temp_uncommitted_and_deleted_but_spares_live_writers(tmp_path):
    root = tmp_path / "s"
    store = HiddenStateStore.create(root, HEADER)
    fill(store, 10, writer_id="dead")
    victim = next(iter(store.shards()))
    store.delete_shard(victim)
    (root / victim).mkdir(parents=True)
    (root / victim / "zarr.json").write_text("{}")
    (root / "shards" / "dead" / "00000099.zarr.tmp-ab").mkdir()
    (root / "shards" / "dead" / "00000098.zarr").mkdir()
    live = store.writer("live")
    s = make_sample(HEADER, "l", 3)
    live.add("l", s.hidden_states, s.token_ids)
    (root / "shards" / "live" / "00000007.zarr.tmp-cd").mkdir()
    dry = store.gc(dry_run=True)
    assert (root / "shards" / "dead" / "00000098.zarr").exists()
    out = store.gc()
    assert (
        {k: out[k] for k in ("removed_temp", "removed_deleted", "removed_uncommitted")}
        == {k: dry[k] for k in ("removed_temp", "removed_deleted", "removed_uncommitted")}
        == {"removed_temp": 1, "removed_deleted": 1, "removed_uncommitted": 1}
    )
    assert out["live_writers"] == 1
    assert (root / "shards" / "live" / "00000007.zarr.tmp-cd").exists()
    live.close()
    assert store.gc()["removed_temp"] == 1
    assert not (root / "shards" / "live" / "00000007.zarr.tmp-cd").exists()
    assert store.verify() == [] and "l" in store


def test_writer_id_in_use_is_refused(tmp_path):
    store = HiddenStateStore.create(tmp_path / "s", HEADER)
    with (
        store.writer("same"),
        pytest.raises(StoreError, match="another process is writing with this writer id"),
    ):
        HiddenStateStore.open(tmp_path / "s").writer("same")
    with pytest.raises(ValueError, match="writer_id"):
        store.writer("../evil")


def test_reading_a_sample_reads_about_its_bytes(tmp_path):
    h = header(hidden_size=256)
    store = HiddenStateStore.create(tmp_path / "s", h)
    with store.writer(shard_bytes=64 << 20) as w:
        for i in range(40):
            s = make_sample(h, f"s{i}", 100)
            w.add(s.sample_id, s.hidden_states, s.token_ids)
    assert len(store.shards()) == 1
    store.read("s0")  # opens the shard, reads metadata and index

    def rchar() -> int:
        return int(
            next(
                ln for ln in Path("/proc/self/io").read_text().splitlines() if ln.startswith("rchar")
            ).split()[1]
        )

    before = rchar()
    store.read("s20")
    used = rchar() - before
    sample_bytes = 100 * h.row_bytes + 100 * 9
    assert sample_bytes <= used <= sample_bytes + 4096, used


def test_background_commit_overlaps_and_a_failed_one_loses_only_its_shard(tmp_path):
    store = HiddenStateStore.create(tmp_path / "s", HEADER)
    w = store.writer("bg", shard_bytes=10 * HEADER.row_bytes)
    samples = [make_sample(HEADER, f"b{i}", 6) for i in range(6)]
    for s in samples[:3]:
        w.add(s.sample_id, s.hidden_states, s.token_ids, s.loss_mask)
    assert w.pending == 3 or len(store) > 0
    assert w.flush() and w.pending == 0
    assert [store.read(s.sample_id).sample_id for s in samples[:3]] == ["b0", "b1", "b2"]
    w.add("b3", samples[3].hidden_states, samples[3].token_ids, samples[3].loss_mask)
    (temp,) = (tmp_path / "s" / "shards" / "bg").glob("*.tmp-*")
    shutil.rmtree(temp)  # the shard being filled is damaged: its seal fails in the background
    w.add("b4", samples[4].hidden_states, samples[4].token_ids, samples[4].loss_mask)  # b3's shard seals
    with pytest.raises(OSError):  # the failed background commit surfaces here; b5 is not added
        w.add("b5", samples[5].hidden_states, samples[5].token_ids, samples[5].loss_mask)
    assert w.lost == 1 and w.pending == 1 and "b3" not in store
    w.add("b5", samples[5].hidden_states, samples[5].token_ids, samples[5].loss_mask)
    assert {r.sample_id for r in w.flush()} == {"b4", "b5"}
    w.close()
    for s in samples[4:]:
        assert_same(store.read(s.sample_id), s)
    assert "b3" not in store and store.verify() == []


def test_a_rejected_sample_leaves_nothing_and_the_shard_goes_on(tmp_path):
    from hsgen.store.errors import SampleRejected

    store = HiddenStateStore.create(tmp_path / "s", HEADER)
    good = [make_sample(HEADER, f"g{i}", 5 + i) for i in range(3)]
    bad = make_sample(HEADER, "nan", 9)
    hidden = bad.hidden_states.copy()
    hidden[7, 1, 3] = 0x7FC0  # bfloat16 NaN
    with store.writer("w") as w:
        w.add(good[0].sample_id, good[0].hidden_states, good[0].token_ids, check_finite=True)
        w.add("nan0", hidden, bad.token_ids)  # not asked to check: stored as it is
        with pytest.raises(SampleRejected, match="'nan': hidden states contain NaN"):
            w.add("nan", hidden, bad.token_ids, check_finite=True)
        for s in good[1:]:
            w.add(s.sample_id, s.hidden_states, s.token_ids, check_finite=True)
    store = HiddenStateStore.open(tmp_path / "s")
    assert sorted(store.sample_ids()) == ["g0", "g1", "g2", "nan0"] and store.verify() == [
        f"{store.path}/{store.record('nan0').shard}: sample 'nan0': 1 hidden-state values are not finite (NaN or "
        "inf) under a valid checksum"
    ]
    for s in good:
        np.testing.assert_array_equal(store.read(s.sample_id).hidden_states, s.hidden_states)


@pytest.mark.parametrize("codec", ["raw", "fp8", "lz4"])
def test_rows_left_in_their_file_are_stored_as_the_same_rows_in_memory(tmp_path, codec):
    """A sample added from the server's file (``FileRows``, read in pieces as it is written) is
    stored byte for byte as the same sample added from memory; a file cut short is rejected."""
    from hsgen.client.hidden_file import read_hidden_states_fd
    from hsgen.store.errors import SampleRejected
    from hsgen.store.shard_builder import PIECE_BYTES

    h = header(codec=codec, hidden_size=1024)
    sample = make_sample(h, "big", 3 * PIECE_BYTES // h.row_bytes + 5)  # several pieces
    path = tmp_path / "f.safetensors"
    from hsgen.protocol import extraction as protocol

    head, _ = protocol.safetensors_header_bytes(
        [
            ("hidden_states", "bfloat16", sample.hidden_states.shape),
            ("token_ids", "int64", sample.token_ids.shape),
        ]
    )
    path.write_bytes(head + sample.hidden_states.tobytes() + sample.token_ids.astype("<i8").tobytes())
    fd = os.open(path, os.O_RDONLY)
    try:
        rows, _ids, _ = read_hidden_states_fd(fd, rows_in_file=True)
        assert not isinstance(rows, np.ndarray)
        a = HiddenStateStore.create(tmp_path / "file", h)
        b = HiddenStateStore.create(tmp_path / "memory", h)
        with a.writer("w") as wa, b.writer("w") as wb:
            wa.add("big", rows, sample.token_ids, sample.loss_mask, check_finite=True)
            wb.add("big", sample.hidden_states, sample.token_ids, sample.loss_mask, check_finite=True)
        assert a.record("big").checksum == b.record("big").checksum
        assert_same(a.read("big"), b.read("big"))
        os.truncate(path, len(head) + sample.hidden_states.nbytes // 2)
        with a.writer("w2") as w, pytest.raises(SampleRejected, match="cannot be read"):
            w.add("cut", rows, sample.token_ids, sample.loss_mask)
    finally:
        rows.close()
        os.close(fd)
    assert "cut" not in HiddenStateStore.open(tmp_path / "file") and a.verify() == []


def test_checksum_follows_the_store_format_version(tmp_path):
    """Version 2 stores write xxh3; a version 1 store keeps bsum64 when a newer hsgen appends to it,
    so the hsgen that created it can still verify it. Either kind is verified."""
    import numpy as np

    from hsgen.store import HiddenStateStore, StoreHeader
    from hsgen.store.codecs import checksum

    for version, prefix in ((1, "bsum64:"), (2, "xxh3:")):
        header = StoreHeader(
            verifier="v", layer_ids=(1,), hidden_size=4, dtype="float32", format_version=version
        )
        st = HiddenStateStore.create(tmp_path / f"v{version}", header)
        hs = np.arange(20, dtype=np.float32).reshape(5, 1, 4)
        with st.writer("w") as w:
            w.add("a", hs, np.arange(5))
        st = HiddenStateStore.open(tmp_path / f"v{version}")
        rec = st.record("a")
        assert rec.checksum.startswith(prefix)
        assert rec.checksum == checksum([hs, np.arange(5, dtype=np.int64), np.ones(5, np.uint8)], prefix[:-1])
        assert st.verify() == []
        shard = tmp_path / f"v{version}" / rec.shard / "hidden_states" / "c" / "0" / "0" / "0"
        data = bytearray(shard.read_bytes())
        data[9] ^= 1
        shard.write_bytes(bytes(data))
        assert any("checksum" in p for p in HiddenStateStore.open(tmp_path / f"v{version}").verify())


@pytest.mark.parametrize("where", ["disk", "tmpfs"])
def test_a_rejected_sample_is_rolled_back_across_written_blocks(tmp_path, where):
    """A sample rejected after some of its blocks were written (``O_DIRECT`` on disk, ordinary
    writes on tmpfs) leaves the shard exactly as before it: the samples around it read back."""
    import tempfile

    from hsgen.store.errors import SampleRejected
    from hsgen.store.shard_builder import BLOCK_BYTES

    base = Path(tempfile.mkdtemp(dir="/dev/shm")) if where == "tmpfs" else tmp_path
    try:
        h = header(hidden_size=1024)
        store = HiddenStateStore.create(base / "s", h)
        a, c = make_sample(h, "a", 100), make_sample(h, "c", 50)
        big = make_sample(h, "big", 3 * BLOCK_BYTES // h.row_bytes)
        hidden = big.hidden_states.copy()
        hidden[-10, 0, 0] = 0x7F80  # bfloat16 inf, in the third block
        with store.writer("w", shard_bytes=1 << 30) as w:
            w.add("a", a.hidden_states, a.token_ids, a.loss_mask, check_finite=True)
            with pytest.raises(SampleRejected):
                w.add("big", hidden, big.token_ids, big.loss_mask, check_finite=True)
            w.add("c", c.hidden_states, c.token_ids, c.loss_mask, check_finite=True)
        store = HiddenStateStore.open(base / "s")
        assert store.sample_ids() == ["a", "c"] and store.verify() == []
        assert_same(store.read("a"), a)
        assert_same(store.read("c"), c)
    finally:
        if where == "tmpfs":
            shutil.rmtree(base)


@pytest.mark.parametrize("algorithm", ["xxh3", "bsum64", "crc32"])
def test_a_checksum_fed_in_any_pieces_is_the_checksum_of_the_whole(algorithm):
    from hsgen.store import codecs as C

    rng = np.random.default_rng(5)
    arrays = [rng.integers(0, 255, n, dtype=np.uint8) for n in (3 * 4096 + 17, 4096, 5, 0, 70001)]
    want = C.checksum(arrays, algorithm)
    for _ in range(20):
        s = C.ChecksumStream(algorithm)
        for a in arrays:
            s.begin(a.nbytes)
            cuts = sorted(rng.integers(0, a.nbytes + 1, rng.integers(0, 6)))
            for lo, hi in zip([0, *cuts], [*cuts, a.nbytes], strict=True):
                s.update(memoryview(a[lo:hi]))
        assert s.hexdigest() == want
