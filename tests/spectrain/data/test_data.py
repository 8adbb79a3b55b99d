"""Data path: split, epoch plan, packing, StoreSource reads, DataLoader workers."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from spectrain.data.sources import (
    Batch,
    PackedLoader,
    StoreSource,
    count_packed_sequences,
    epoch_plan,
    split_of,
    storage_to_torch,
    token_frequencies,
)


@dataclass
class FakeSample:
    sample_id: str
    hidden_states: np.ndarray
    token_ids: np.ndarray
    loss_mask: np.ndarray
    dtype: str = "float32"


class MemorySource:
    """In-memory SampleSource: sample i has i+lengths tokens whose ids and states encode (sample, position)."""

    def __init__(self, lengths: dict[str, int], missing: tuple[str, ...] = ()):
        self.lengths_ = lengths
        self.missing = set(missing)
        self.consumed_ids: list[str] = []

    def plan(self, epoch: int) -> list[str]:
        return epoch_plan(list(self.lengths_), epoch, seed=0)

    def get(self, sid: str):
        if sid in self.missing:
            return None
        n = self.lengths_[sid]
        k = int(sid[1:])
        toks = np.arange(n, dtype=np.int64) + 100 * k
        hs = np.zeros((n, 3, 2), np.float32)
        hs[:, :, 0] = k
        hs[:, :, 1] = np.arange(n)[:, None]
        hs[:, 2, 0] = -k
        mask = (np.arange(n) % 2).astype(np.uint8)
        return FakeSample(sid, hs, toks, mask)

    def consumed(self, ids):
        self.consumed_ids.extend(ids)

    def close(self):
        pass

    def lengths(self, ids):
        return [self.lengths_[i] for i in ids]


def test_split_is_stable_when_ids_are_added():
    ids = [f"sample-{i}" for i in range(2000)]
    before = {i: split_of(i, 0.1) for i in ids}
    more = ids + [f"new-{i}" for i in range(500)]
    after = {i: split_of(i, 0.1) for i in more}
    assert all(after[i] == before[i] for i in ids)
    share = sum(v == "validation" for v in before.values()) / len(ids)
    assert 0.07 < share < 0.13


def test_epoch_plan_is_seeded_and_sharded():
    ids = [f"x{i}" for i in range(101)]
    p0 = epoch_plan(ids, 0, seed=3)
    assert p0 == epoch_plan(list(reversed(ids)), 0, seed=3)  # input order does not matter
    assert p0 != epoch_plan(ids, 1, seed=3)
    assert sorted(p0) == sorted(ids)
    shards = [epoch_plan(ids, 0, seed=3, rank=r, world_size=3) for r in range(3)]
    assert shards[1] == p0[1::3]
    assert sorted(sum(shards, [])) == sorted(ids)


def test_packing_respects_documents():
    lengths = {"s1": 5, "s2": 7, "s3": 4, "s4": 9, "s5": 3}
    src = MemorySource(lengths)
    plan = ["s1", "s2", "s3", "s4", "s5"]
    batches = list(PackedLoader(src, plan, total_seq_len=16, layers=[0, 2], hidden_dtype=torch.float32))
    assert [b.sample_ids for b in batches] == [["s1", "s2", "s3"], ["s4", "s5"]]
    assert [(b.plan_start, b.plan_end) for b in batches] == [(0, 3), (3, 5)]
    assert len(batches) == count_packed_sequences([lengths[i] for i in plan], 16)
    b = batches[0]
    assert b.seq_len == 16 and b.num_tokens == 16
    assert b.position_ids.tolist() == [*range(5), *range(7), *range(4)]
    assert b.doc_ids.tolist() == [0] * 5 + [1] * 7 + [2] * 4
    assert b.doc_ends.tolist() == [5] * 5 + [12] * 7 + [16] * 4
    assert b.input_ids[5:12].tolist() == list(range(200, 207))
    # layers 0 and 2 kept, in that order: layer 2 carries -k
    assert b.hidden_states.shape == (16, 2, 2)
    assert b.hidden_states[6, 0].tolist() == [2.0, 1.0]
    assert b.hidden_states[6, 1].tolist() == [-2.0, 1.0]
    assert b.loss_mask[:5].tolist() == [False, True, False, True, False]
    pad = batches[1]
    assert pad.num_tokens == 12
    assert (pad.doc_ids[12:] == -1).all() and not pad.loss_mask[12:].any()
    assert (pad.hidden_states[12:] == 0).all()
    assert pad.doc_ends[12:].tolist() == [13, 14, 15, 16]


def test_packing_resume_matches_straight_run_and_skips_missing():
    lengths = {f"s{i}": 3 + (i * 7) % 11 for i in range(1, 30)}
    src = MemorySource(lengths, missing=("s4",))
    plan = src.plan(0)
    full = list(PackedLoader(src, plan, total_seq_len=24, layers=None, hidden_dtype=torch.float32))
    assert sum(len(b.sample_ids) for b in full) == len(plan)
    cut = full[3].plan_start
    rest = list(PackedLoader(src, plan, start=cut, total_seq_len=24, layers=None, hidden_dtype=torch.float32))
    assert [b.sample_ids for b in rest] == [b.sample_ids for b in full[3:]]
    for a, b in zip(rest, full[3:], strict=True):
        assert torch.equal(a.hidden_states, b.hidden_states) and torch.equal(a.input_ids, b.input_ids)


def test_long_sample_is_truncated():
    src = MemorySource({"s1": 40, "s2": 3})
    batches = list(PackedLoader(src, ["s1", "s2"], total_seq_len=16, layers=None, hidden_dtype=torch.float32))
    assert [b.num_tokens for b in batches] == [16, 3]
    assert batches[0].doc_ends.tolist() == [16] * 16


def test_bf16_view_is_zero_copy():
    a = np.arange(12, dtype=np.uint16).reshape(3, 4) + 16256
    t = storage_to_torch(a, "bfloat16")
    assert t.dtype == torch.bfloat16
    assert t.data_ptr() == a.ctypes.data
    assert torch.equal(t.view(torch.uint16), torch.from_numpy(a))
    with pytest.raises(ValueError, match="uint16"):
        storage_to_torch(np.zeros(3, np.float32), "bfloat16")


def test_store_source_reads_and_splits(tiny_store):
    from hsgen.store import HiddenStateStore

    store = HiddenStateStore.open(tiny_store)
    train = StoreSource(tiny_store, split="train", val_fraction=0.2)
    val = StoreSource(tiny_store, split="validation", val_fraction=0.2)
    tids, vids = train.ids(), val.ids()
    assert not set(tids) & set(vids)
    assert sorted(tids + vids) == sorted(store.sample_ids())
    assert vids, "20% of 48 ids should give some validation samples"
    r0 = StoreSource(tiny_store, rank=0, world_size=2).plan(1)
    r1 = StoreSource(tiny_store, rank=1, world_size=2).plan(1)
    assert not set(r0) & set(r1) and len(r0) + len(r1) == len(StoreSource(tiny_store).ids())
    sid = tids[0]
    sample = train.get(sid)
    assert sample.hidden_states.dtype == np.uint16
    assert train.get("no-such-id") is None
    assert train.lengths([sid]) == [len(sample.token_ids)]
    batch = next(
        iter(PackedLoader(train, [sid], total_seq_len=512, layers=[0, 1, 2, 3], hidden_dtype=torch.bfloat16))
    )
    n = len(sample.token_ids)
    assert torch.equal(batch.hidden_states[:n].view(torch.uint16), torch.from_numpy(sample.hidden_states))


def test_workers_give_the_same_batches(tiny_store):
    src = StoreSource(tiny_store, val_fraction=0.0)
    plan = src.plan(0)
    kw = dict(total_seq_len=400, layers=[0, 1, 3], hidden_dtype=torch.bfloat16)
    a = list(PackedLoader(src, plan, num_workers=0, **kw))
    b = list(PackedLoader(src, plan, num_workers=2, **kw))
    assert len(a) == len(b) == count_packed_sequences(src.lengths(plan), 400)
    for x, y in zip(a, b, strict=True):
        assert isinstance(y, Batch) and x.sample_ids == y.sample_ids
        assert torch.equal(x.hidden_states.view(torch.uint16), y.hidden_states.view(torch.uint16))
        assert torch.equal(x.loss_mask, y.loss_mask)


def test_token_frequencies_count_loss_masked_tokens():
    src = MemorySource({"s1": 6, "s2": 4})
    counts = token_frequencies(src, ["s1", "s2"], 300)
    assert counts[101] == 1 and counts[100] == 0  # odd positions carry mask 1
    assert counts.sum() == 3 + 2
    with pytest.raises(ValueError, match="outside the vocabulary"):
        token_frequencies(src, ["s2"], 150)


def test_buffers_are_reused_only_when_released():
    src = MemorySource({f"s{i}": 10 for i in range(1, 25)})
    plan = [f"s{i}" for i in range(1, 25)]
    kept = list(PackedLoader(src, plan, total_seq_len=20, layers=None, hidden_dtype=torch.float32))
    ptrs = {b.hidden_states.data_ptr() for b in kept}
    assert len(ptrs) == len(kept) == 12  # all alive: no sharing
    assert [b.hidden_states[0, 0, 0].item() for b in kept[:4]] == [1.0, 3.0, 5.0, 7.0]
    seen = set()
    loader = PackedLoader(src, plan, total_seq_len=20, layers=None, hidden_dtype=torch.float32, ahead=2)
    for b in loader:
        seen.add(b.hidden_states.data_ptr())
        del b
    # released batches give their buffer back: the one in use, those ready ahead, the one being packed
    assert len(seen) <= loader.ahead + 2 < 12
    assert len(loader.buffers._kept) <= loader.buffers.size


def test_padding_is_zero_in_reused_buffers_and_zeroed_only_where_written():
    from spectrain.data.loader import BufferPool

    # sequences of 20 slots holding 20, 5, 20, 3, 12, 20, 7 tokens: padding after fuller sequences
    lengths = [10, 10, 5, 10, 10, 3, 12, 10, 10, 7]
    src = MemorySource({f"s{i}": n for i, n in enumerate(lengths, 1)})
    plan = [f"s{i}" for i in range(1, len(lengths) + 1)]
    pool = BufferPool(3)
    for _ in range(2):  # the second pass reuses every buffer of the first
        ptrs = set()
        for b in PackedLoader(src, plan, total_seq_len=20, layers=None, hidden_dtype=torch.float32, ahead=1,
                              buffers=pool):  # fmt: skip
            ptrs.add(b.hidden_states.data_ptr())
            n = b.num_tokens
            assert n > 0 and (b.hidden_states[n:] == 0).all() and (b.doc_ids[n:] == -1).all()
            assert (b.hidden_states[:n, 0, 0] != 0).all()  # ids are 1..: every data row is written
            del b
        assert len(ptrs) <= 3
    assert len(pool._kept) <= 3


def test_buffer_pool_hands_out_the_buffer_needing_the_least_zeroing():
    from spectrain.data.loader import BufferPool

    pool = BufferPool(4)
    shape = (10, 1, 2)
    bufs = [pool.take(shape, torch.float32, 10) for _ in range(3)]
    assert [dirty for _, dirty in bufs] == [10, 10, 10]  # fresh: anything may be in them
    for (buf, _), used in zip(bufs, (8, 3, 6), strict=True):
        pool.settle(buf, used)  # their padding was zeroed after 8, 3 and 6 rows
    ptr = {used: buf.data_ptr() for (buf, _), used in zip(bufs, (8, 3, 6), strict=True)}
    del bufs, buf
    got, dirty = pool.take(shape, torch.float32, 7)
    assert (got.data_ptr(), dirty) == (ptr[6], 6)  # the dirtiest not past 7 rows: nothing to zero
    got2, dirty2 = pool.take(shape, torch.float32, 2)
    assert (got2.data_ptr(), dirty2) == (ptr[3], 3)  # none fits: the cleanest, 1 row to zero
    del got, got2
    got3, dirty3 = pool.take(shape, torch.float32, None)
    assert (got3.data_ptr(), dirty3) == (ptr[3], 3)  # length not known yet: the cleanest


class RecordingRead:
    """A SampleRead that records the thread it ran on and when."""

    def __init__(self, sid: str, n: int, log: list, corrupt: bool = False):
        self.sample_id, self.length, self.dtype, self.row_shape = sid, n, "float32", (2, 3)
        self.log, self.corrupt = log, corrupt

    def read_into(self, hidden, token_ids, loss_mask):
        from spectrain.data.sample_reads import SampleRefused

        self.log.append((self.sample_id, threading.current_thread().name))
        if self.corrupt:
            raise SampleRefused(f"store /x: shard s/1.zarr: sample {self.sample_id!r}: checksum bad")
        hidden[...] = int(self.sample_id[1:])
        token_ids[...] = np.arange(self.length)
        loss_mask[...] = 1


class LocatingSource(MemorySource):
    def __init__(self, lengths, corrupt=()):
        super().__init__(lengths)
        self.log: list = []
        self.corrupt = set(corrupt)
        self.refused_ids: list = []

    def locate(self, sid):
        return RecordingRead(sid, self.lengths_[sid], self.log, sid in self.corrupt)

    def refused(self, sid, reason):
        self.refused_ids.append((sid, reason))


def test_next_sequence_is_packed_off_the_training_thread_while_a_step_runs():
    src = LocatingSource({f"s{i}": 8 for i in range(1, 9)})
    plan = [f"s{i}" for i in range(1, 9)]
    it = iter(PackedLoader(src, plan, total_seq_len=16, layers=None, hidden_dtype=torch.float32, ahead=2))
    first = next(it)
    assert first.sample_ids == ["s1", "s2"]
    deadline = time.monotonic() + 600
    while len(src.log) < 6 and time.monotonic() < deadline:  # the "step": the consumer does nothing
        time.sleep(0.01)
    read = [sid for sid, _ in src.log]
    assert {"s3", "s4", "s5", "s6"} <= set(read)  # the next two sequences were read during the step
    rest = list(it)
    assert [b.sample_ids for b in rest] == [["s3", "s4"], ["s5", "s6"], ["s7", "s8"]]
    assert all(b.hidden_states[0, 0, 0].item() == int(b.sample_ids[0][1:]) for b in rest)
    assert all(name != threading.main_thread().name for _, name in src.log)


@pytest.mark.parametrize("waits", [True, False])
def test_a_source_whose_locate_waits_gets_each_read_started_at_once(waits):
    gate = threading.Event()

    class Waiting(LocatingSource):
        locate_waits = waits

        def locate(self, sid):
            if sid == "s3":
                gate.wait(30)  # an online source waiting for a fetch
            return super().locate(sid)

    src = Waiting({"s1": 4, "s2": 4, "s3": 4})
    it = iter(
        PackedLoader(src, ["s1", "s2", "s3"], total_seq_len=16, layers=None, hidden_dtype=torch.float32)
    )
    deadline = time.monotonic() + (30 if waits else 0.5)
    while len(src.log) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    # copies overlap the wait for s3 when locate waits; otherwise they start when the sequence closes
    assert sorted(sid for sid, _ in src.log) == (["s1", "s2"] if waits else [])
    gate.set()
    (b,) = list(it)
    assert b.sample_ids == ["s1", "s2", "s3"] and b.num_tokens == 12
    assert [b.hidden_states[i, 0, 0].item() for i in (0, 4, 8)] == [1.0, 2.0, 3.0]


def test_a_refused_sample_becomes_padding_and_is_reported():
    src = LocatingSource({"s1": 5, "s2": 7, "s3": 4}, corrupt=("s2",))
    loader = PackedLoader(src, ["s1", "s2", "s3"], total_seq_len=16, layers=None, hidden_dtype=torch.float32)
    (b,) = list(loader)
    assert b.sample_ids == ["s1", "s2", "s3"] and b.plan_end == 3  # packing unchanged: resume stays exact
    assert b.doc_ids.tolist() == [0] * 5 + [-1] * 7 + [2] * 4 + [-1] * 0
    assert not b.loss_mask[5:12].any() and (b.hidden_states[5:12] == 0).all()
    assert b.doc_ends[5:12].tolist() == list(range(6, 13))
    assert (b.hidden_states[12:16] == 3).all() and b.loss_mask[12:16].all()
    assert loader.refused == ["s2"]
    assert src.refused_ids and "s2" in src.refused_ids[0][1] and "shard" in src.refused_ids[0][1]


def test_store_samples_are_checked_and_a_damaged_one_is_skipped(tiny_store, tmp_path, caplog):
    import shutil

    from hsgen.store import HiddenStateStore

    path = tmp_path / "store"
    shutil.copytree(tiny_store, path)
    store = HiddenStateStore.open(path)
    sid = store.sample_ids()[5]
    rec = store.record(sid)
    row = store.header.num_layers * store.header.hidden_size * 2
    with open(path / rec.shard / "hidden_states/c/0/0/0", "r+b") as f:  # NaN over one token's first layer
        f.seek((rec.offset + 1) * row)
        f.write(np.full(store.header.hidden_size, 0x7FC0, np.uint16).tobytes())
    src = StoreSource(path, val_fraction=0.0)
    plan = src.plan(0)
    kw = dict(total_seq_len=512, layers=[0, 1, 2, 3], hidden_dtype=torch.bfloat16)
    loader = PackedLoader(src, plan, **kw)
    batches = list(loader)
    assert loader.refused == [sid]
    assert any(
        str(path) in r.message and rec.shard in r.message and repr(sid) in r.message for r in caplog.records
    )
    for b in batches:
        assert torch.isfinite(b.hidden_states.float()).all()
        if sid in b.sample_ids:
            assert b.loss_mask.sum() > 0  # the other samples of the sequence still train
    unchecked = PackedLoader(StoreSource(path, val_fraction=0.0, verify=False), plan, **kw)
    assert any(not torch.isfinite(b.hidden_states.float()).all() for b in unchecked)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_sequences_arrive_on_the_device_equal_to_the_host_ones(tiny_store):
    src = StoreSource(tiny_store, val_fraction=0.0)
    plan = src.plan(0)
    kw = dict(total_seq_len=400, layers=[0, 1, 3], hidden_dtype=torch.bfloat16)
    host = list(PackedLoader(src, plan, **kw))
    for _ in range(2):  # the second pass gets pinned buffers with the first's stale rows
        dev = [b.to("cpu") for b in PackedLoader(src, plan, pin_memory=True, device="cuda", **kw)]
        torch.cuda.synchronize()
        assert len(host) == len(dev)
        for h, d in zip(host, dev, strict=True):
            assert d.sample_ids == h.sample_ids and d.num_tokens == h.num_tokens
            for a, b in zip(h.tensors(), d.tensors(), strict=True):
                assert torch.equal(a, b)  # padding included: zeroed on the device


def test_estimated_packed_sequences_sample_long_plans_only():
    import random

    from spectrain.data.sources import LENGTH_SAMPLE, epoch_plan, estimate_packed_sequences

    rng = random.Random(0)
    ids = [f"s{i:06d}" for i in range(6 * LENGTH_SAMPLE)]
    length = {i: int(rng.lognormvariate(5.5, 0.8)) for i in ids}  # chats of ~250 tokens, long tail
    asked: list[int] = []

    def lengths(sub):
        asked.append(len(sub))
        return [length[i] for i in sub]

    plan = epoch_plan(ids, 0, seed=1)
    exact = count_packed_sequences([length[i] for i in plan], 2048)
    est = estimate_packed_sequences(plan, lengths, 2048, exact=False)
    assert asked == [LENGTH_SAMPLE]  # only the sample was measured
    assert abs(est - exact) / exact < 0.03
    asked.clear()
    assert estimate_packed_sequences(plan, lengths, 2048) == exact and asked == [len(plan)]
    short = plan[:100]
    assert estimate_packed_sequences(short, lengths, 2048, exact=False) == count_packed_sequences(
        [length[i] for i in short], 2048
    )
