"""Property-based conformance suite for hsgen.store (hypothesis).

A state machine drives random adds, flushes, deletes, reopens and manifest truncations against a
plain dict model; every step checks the store agrees with the model and with zarr itself.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
import zarr
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from hsgen.store import HiddenStateStore, StoreHeader
from hsgen.store.fsutil import write_all
from hsgen.store.synthetic import make_sample

SETTINGS = settings(
    max_examples=20, stateful_step_count=14, deadline=None, suppress_health_check=list(HealthCheck)
)


class StoreMachine(RuleBasedStateMachine):
    """Random operations on a store, checked against a dict of the samples it must hold."""

    @initialize(
        dtype=st.sampled_from(["bfloat16", "float16", "float32"]),
        codec=st.sampled_from(["raw", "lz4"]),
        layers=st.integers(1, 3),
        hidden=st.integers(1, 9),
        chunk_bytes=st.integers(1, 300),
        shard_rows=st.integers(1, 40),
    )
    def setup(self, dtype, codec, layers, hidden, chunk_bytes, shard_rows):
        self.dir = Path(tempfile.mkdtemp(prefix="hsgen-prop-"))
        self.header = StoreHeader("m", tuple(range(layers)), hidden, dtype, codec=codec)
        self.store = HiddenStateStore.create(self.dir / "s", self.header)
        self.writer = self.store.writer(
            "w0", shard_bytes=shard_rows * self.header.row_bytes, chunk_bytes=chunk_bytes
        )
        self.model: dict[str, object] = {}
        self.pending: dict[str, object] = {}
        self.counter = 0

    def teardown(self):
        if hasattr(self, "writer"):
            self.writer.close()
            self.store.close()
            shutil.rmtree(self.dir, ignore_errors=True)

    def _sync_pending(self):
        for sid in [s for s in self.pending if s in self.store]:
            self.model[sid] = self.pending.pop(sid)

    @rule(tokens=st.integers(1, 30), seed=st.integers(0, 3))
    def add(self, tokens, seed):
        sid = f"id-{self.counter}"
        self.counter += 1
        s = make_sample(self.header, sid, tokens, seed)
        self.writer.add(sid, s.hidden_states, s.token_ids, s.loss_mask)
        self.pending[sid] = s
        self._sync_pending()

    @rule()
    def flush(self):
        recs = self.writer.flush()
        assert {r.sample_id for r in recs} == set(self.pending)
        self._sync_pending()
        assert not self.pending

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def delete_a_shard(self, data):
        shards = self.store.shards()
        name = data.draw(st.sampled_from(sorted(shards)))
        self.store.delete_shard(name)
        for sid in shards[name]:
            self.model.pop(sid, None)
        self.store.delete_shard(name)

    @rule()
    def reopen(self):
        other = HiddenStateStore.open(self.dir / "s")
        assert other.sample_ids() == self.store.sample_ids()
        other.close()

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def torn_copy_replays_a_prefix(self, data):
        copy = self.dir / "copy"
        shutil.rmtree(copy, ignore_errors=True)
        shutil.copytree(self.dir / "s", copy)
        manifest = copy / "manifests" / "w0.jsonl"
        raw = manifest.read_bytes()
        cut = data.draw(st.integers(0, len(raw)))
        manifest.write_bytes(raw[:cut])
        torn = HiddenStateStore.open(copy)
        ids = set(torn.sample_ids())
        assert ids <= set(self.store.sample_ids())
        lines = [json.loads(x) for x in raw[:cut].split(b"\n")[:-1]]
        committed = {r["shard"] for r in lines if r["op"] == "commit"}
        expected = {r["id"] for r in lines if r["op"] == "add" and r["shard"] in committed}
        assert ids == expected & set(self.store.sample_ids())
        for sid in ids:
            got = torn.read(sid, verify=True)
            np.testing.assert_array_equal(got.hidden_states, self.model[sid].hidden_states)
        assert torn.verify() == []
        assert set(torn.shards()) <= committed
        torn.close()

    @invariant()
    def agrees_with_model(self):
        if not hasattr(self, "store"):
            return
        self.writer._wait_inflight()  # a shard handed to the background commit thread lands first
        self._sync_pending()
        assert set(self.store.sample_ids()) == set(self.model)
        assert len(self.store) == len(self.model)
        for sid, want in self.model.items():
            got = self.store.read(sid)
            assert got.hidden_states.dtype == self.header.storage_dtype
            np.testing.assert_array_equal(got.hidden_states, want.hidden_states)
            np.testing.assert_array_equal(got.token_ids, want.token_ids)
            np.testing.assert_array_equal(got.loss_mask, want.loss_mask)
            rec = self.store.record(sid)
            arr = zarr.open_array(self.dir / "s" / rec.shard / "hidden_states", mode="r")
            np.testing.assert_array_equal(arr[rec.offset : rec.offset + rec.length], want.hidden_states)
        stats = self.store.stats()
        assert stats["samples"] == len(self.model)
        assert stats["tokens"] == sum(len(s.token_ids) for s in self.model.values())


TestStoreMachine = StoreMachine.TestCase
TestStoreMachine.settings = SETTINGS


@settings(max_examples=30, deadline=None)
@given(sizes=st.lists(st.integers(0, 70), min_size=0, max_size=1500))
def test_write_all_writes_every_buffer_in_order(sizes):
    bufs = [bytes([i % 251]) * n for i, n in enumerate(sizes)]
    with tempfile.TemporaryFile() as f:
        assert write_all(f.fileno(), bufs) == sum(sizes)
        f.seek(0)
        assert f.read() == b"".join(bufs)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    lengths=st.lists(st.integers(1, 25), min_size=1, max_size=8),
    chunk_bytes=st.integers(1, 400),
    dtype=st.sampled_from(["bfloat16", "float16", "float32"]),
)
def test_fp8_round_trip_error_is_bounded(tmp_path_factory, lengths, chunk_bytes, dtype):
    import ml_dtypes

    header = StoreHeader("m", (0, 1), 8, dtype, codec="fp8")
    store = HiddenStateStore.create(tmp_path_factory.mktemp("fp8") / "s", header)
    samples = [make_sample(header, f"x{i}", n, i) for i, n in enumerate(lengths)]
    with store.writer(chunk_bytes=chunk_bytes) as w:
        for s in samples:
            w.add(s.sample_id, s.hidden_states, s.token_ids, s.loss_mask)
    logical = {"bfloat16": ml_dtypes.bfloat16, "float16": np.float16, "float32": np.float32}[dtype]
    for s in samples:
        got = store.read(s.sample_id, verify=True)
        want = s.hidden_states.view(logical).astype(np.float32)
        have = got.hidden_states.view(logical).astype(np.float32)
        scale = np.abs(want).max(axis=-1, keepdims=True) / 448
        assert (np.abs(have - want) <= 0.07 * np.abs(want) + scale / 256).all()
        rec = store.record(s.sample_id)
        group = zarr.open_group(store.path / rec.shard, mode="r")
        q = group["hidden_states"][rec.offset : rec.offset + rec.length].view(ml_dtypes.float8_e4m3fn)
        sc = group["hidden_scale"][rec.offset : rec.offset + rec.length]
        np.testing.assert_allclose(
            q.astype(np.float32) * sc[..., None], want, rtol=0.07, atol=float(scale.max()) / 256
        )
    assert os.path.exists(store.path / "hsgen-store.json")


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 20_000),
    data=st.data(),
)
def test_bsum64_detects_any_byte_change_and_word_swap(n, data):
    from hsgen.store.codecs import checksum

    rng = np.random.default_rng(n)
    a = rng.integers(0, 256, n, dtype=np.uint8)
    tail = rng.integers(0, 256, 7, dtype=np.uint8)
    base = checksum([a, tail])
    assert base.startswith("bsum64:") and len(base) == len("bsum64:") + 16
    assert checksum([np.concatenate([a, tail])]) != base  # array boundaries count
    i = data.draw(st.integers(0, n - 1))
    flip = data.draw(st.integers(1, 255))
    b = a.copy()
    b[i] ^= flip
    assert checksum([b, tail]) != base
    if n >= 16:
        words = a[: n // 8 * 8].view(np.uint64).copy()
        j, k = data.draw(st.integers(0, len(words) - 1)), data.draw(st.integers(0, len(words) - 1))
        if words[j] != words[k]:
            words[j], words[k] = words[k], words[j]
            c = a.copy()
            c[: n // 8 * 8] = words.view(np.uint8)
            assert checksum([c, tail]) != base


def test_crc32_checksum_matches_zlib():
    import zlib

    from hsgen.store.codecs import checksum, checksum_like

    a, b = np.arange(1000, dtype=np.int64), np.ones(7, np.uint8)
    want = f"crc32:{zlib.crc32(a.tobytes() + b.tobytes()):08x}"
    assert checksum([a, b], "crc32") == want == checksum_like(want, [a, b])


def test_prometheus_parser_agrees_with_prometheus_client():
    """The hand-written parser (kept: 20x faster, see docs/benchmarks.md) against the maintained one."""
    import importlib.util
    import pathlib

    from prometheus_client.parser import text_string_to_metric_families

    from hsgen.protocol.extraction import parse_prometheus

    spec = importlib.util.spec_from_file_location(
        "bench_parsers", pathlib.Path(__file__).parents[3] / "scripts" / "bench_parsers.py"
    )
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    page = bench._vllm_metrics_page(models=2) + 'odd_metric{a="x y",b="}"} 1.5e3\nplain 2\n'
    expected: dict[str, float] = {}
    for family in text_string_to_metric_families(page):
        for s in family.samples:
            expected[s.name] = expected.get(s.name, 0.0) + s.value
    assert parse_prometheus(page) == expected
