"""Crash safety with real ``kill -9``: the store always opens, verifies and resumes.

Writer processes print each sample id once ``flush`` has returned (durable). After a SIGKILL,
every durable sample must read back bit-exact, nothing torn may be visible, and a resumed
writer must finish the job.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from hsgen.store import HiddenStateStore, StoreHeader
from hsgen.store.synthetic import make_sample

HEADER = StoreHeader(verifier="tiny", layer_ids=(0, 3), hidden_size=64, dtype="bfloat16")

WRITER = r"""
import sys
from hsgen.store import HiddenStateStore, StoreHeader
from hsgen.store.synthetic import make_sample
path, writer_id, start, stop, codec = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
hidden, shard_rows = int(sys.argv[6]), int(sys.argv[7])
header = StoreHeader(verifier="tiny", layer_ids=(0, 3), hidden_size=hidden, dtype="bfloat16", codec=codec)
store = HiddenStateStore.create(path, header)
print("READY", flush=True)
with store.writer(None if writer_id == "-" else writer_id, shard_bytes=shard_rows * header.row_bytes, chunk_bytes=2048) as w:
    known = len(store)
    for i in range(start, stop):
        sid = f"s{i}"
        if sid in store:
            continue
        s = make_sample(header, sid, 1 + i % 13, seed=7)
        w.add(sid, s.hidden_states, s.token_ids, s.loss_mask)
        if len(store) != known:
            known = len(store)
            print("DURABLE", *store.sample_ids(), flush=True)
print("DONE", flush=True)
"""


def spawn(path: Path, writer_id: str, start: int, stop: int, *, codec="raw", failpoint: str | None = None,
          hidden: int = 64, shard_rows: int = 24):  # fmt: skip
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("HSGEN_STORE_FAILPOINT", None)
    if failpoint:
        env["HSGEN_STORE_FAILPOINT"] = failpoint
    return subprocess.Popen(
        [
            sys.executable,
            "-c",
            WRITER,
            str(path),
            *map(str, (writer_id, start, stop, codec, hidden, shard_rows)),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


def durable_ids(stdout: str) -> set[str]:
    ids: set[str] = set()
    for line in stdout.splitlines():
        if line.startswith("DURABLE"):
            ids |= set(line.split()[1:])
    return ids


def check_store(path: Path, must_have: set[str]) -> HiddenStateStore:
    store = HiddenStateStore.open(path)
    assert store.verify() == []
    assert must_have <= set(store.sample_ids())
    for sid in store.sample_ids():
        i = int(sid[1:])
        want = make_sample(store.header, sid, 1 + i % 13, seed=7)
        got = store.read(sid)
        np.testing.assert_array_equal(got.hidden_states, want.hidden_states)
        np.testing.assert_array_equal(got.token_ids, want.token_ids)
        np.testing.assert_array_equal(got.loss_mask, want.loss_mask)
    return store


def finish(proc: subprocess.Popen, timeout: float = 600) -> str:
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, err
    return out


@pytest.mark.parametrize("codec", ["raw", pytest.param("lz4", marks=pytest.mark.slow)])
def test_random_kill_9_then_verify_and_resume(tmp_path, codec):
    path = tmp_path / "store"
    rng = random.Random(1234)
    durable: set[str] = set()
    total, kills = 1500, 0
    for round_ in range(6):
        proc = spawn(path, "w0" if round_ % 2 else "-", 0, total, codec=codec)
        assert proc.stdout.readline().strip() == "READY"
        seen = ""
        if round_ % 3 == 2:  # some kills land after a commit however slow the codec or the machine
            while not seen.startswith(("DURABLE", "DONE")):
                seen = proc.stdout.readline()
                if not seen:
                    break
        time.sleep(rng.uniform(0.0, 0.3))
        proc.send_signal(signal.SIGKILL)
        out, _ = proc.communicate(timeout=600)
        out = seen + out
        assert proc.returncode in (0, -signal.SIGKILL)
        kills += proc.returncode == -signal.SIGKILL
        durable |= durable_ids(out)
        check_store(path, durable)
    assert kills >= 4 and durable
    finish(spawn(path, "w0", 0, total, codec=codec), timeout=600)
    store = check_store(path, durable)
    assert set(store.sample_ids()) == {f"s{i}" for i in range(total)}
    store.gc()
    assert store.verify() == []
    assert not [p for p in (path / "shards").rglob("*") if ".tmp-" in p.name or ".trash-" in p.name]


@pytest.mark.parametrize("point", ["shard_written", "shard_renamed", "manifest_torn"])
def test_kill_9_at_each_commit_step(tmp_path, point):
    path = tmp_path / "store"
    finish(spawn(path, "w", 0, 30))
    before = set(HiddenStateStore.open(path).sample_ids())
    proc = spawn(path, "w", 30, 60, failpoint=point)
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == -signal.SIGKILL
    assert durable_ids(out) == set()
    store = check_store(path, before)
    assert set(store.sample_ids()) == before
    leftovers = store.gc(dry_run=True)
    expected = {
        "shard_written": "removed_temp",
        "shard_renamed": "removed_uncommitted",
        "manifest_torn": "removed_uncommitted",
    }
    # the shard being filled next may have its temp directory already (rows land as they are added)
    assert leftovers[expected[point]] == 1 or (point == "shard_written" and leftovers["removed_temp"] == 2)
    assert leftovers["removed_temp"] <= 2
    if point == "manifest_torn":
        assert not (path / "manifests" / "w.jsonl").read_bytes().endswith(b"\n")
    finish(spawn(path, "w", 30, 60))
    store = check_store(path, before)
    assert set(store.sample_ids()) == {f"s{i}" for i in range(60)}
    assert store.gc()["removed_uncommitted"] == 0


def _takes_direct_io(path: Path) -> bool:
    path.mkdir(parents=True, exist_ok=True)
    try:
        os.close(os.open(path / ".direct-probe", os.O_WRONLY | os.O_CREAT | getattr(os, "O_DIRECT", 0)))
    except OSError:
        return False
    finally:
        (path / ".direct-probe").unlink(missing_ok=True)
    return hasattr(os, "O_DIRECT")


BIG = {"hidden": 8192, "shard_rows": 384}
"""Rows of 32 KiB, shards of 12 MiB: each shard's rows go out in several 4 MiB ``O_DIRECT`` blocks
(the samples above are too small to fill one block, so their rows are only written at the seal)."""


def test_kill_9_while_rows_go_out_with_o_direct_then_verify_and_resume(tmp_path):
    """Issue 33: the writer lands rows through staging buffers written with ``O_DIRECT`` while the
    shard fills. A kill right after a block went out (the failpoint), and at random moments while
    blocks are written, leaves a store that opens, verifies, holds every durable sample bit for bit
    and resumes; the half-written shard is a ``.tmp-`` directory that the next writer removes."""
    path = tmp_path / "store"
    if not _takes_direct_io(tmp_path / "probe"):
        pytest.skip(f"{tmp_path} does not take O_DIRECT")
    finish(spawn(path, "w", 0, 60, **BIG))
    before = set(HiddenStateStore.open(path).sample_ids())
    proc = spawn(path, "w", 60, 120, failpoint="rows_block_written", **BIG)
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == -signal.SIGKILL, "no rows block was written with O_DIRECT"
    assert durable_ids(out) == set()
    store = check_store(path, before)
    assert set(store.sample_ids()) == before
    assert store.gc(dry_run=True)["removed_temp"] >= 1  # the shard being filled, one block in
    rng = random.Random(33)
    durable = set(before)
    for _ in range(3):
        proc = spawn(path, "w", 60, 200, **BIG)
        assert proc.stdout.readline().strip() == "READY"
        time.sleep(rng.uniform(0.05, 0.6))
        proc.send_signal(signal.SIGKILL)
        out, _ = proc.communicate(timeout=600)
        durable |= durable_ids(out)
        check_store(path, durable)
    finish(spawn(path, "w", 60, 200, **BIG))
    store = check_store(path, durable)
    assert set(store.sample_ids()) == {f"s{i}" for i in range(200)}
    store.gc()
    assert not [p for p in (path / "shards").rglob("*") if ".tmp-" in p.name]


def test_kill_9_between_tombstone_and_unlink(tmp_path):
    path = tmp_path / "store"
    finish(spawn(path, "w", 0, 40))
    store = HiddenStateStore.open(path)
    victim, ids = next(iter(store.shards().items()))
    code = (
        "import sys; from hsgen.store import HiddenStateStore; "
        "HiddenStateStore.open(sys.argv[1]).delete_shard(sys.argv[2])"
    )
    env = {**os.environ, "HSGEN_STORE_FAILPOINT": "tombstoned"}
    proc = subprocess.run(
        [sys.executable, "-c", code, str(path), victim], env=env, capture_output=True, timeout=600
    )
    assert proc.returncode == -signal.SIGKILL
    assert (path / victim).exists()
    store = check_store(path, set())
    assert not set(ids) & set(store.sample_ids())
    store.delete_shard(victim)
    assert not (path / victim).exists()
    assert len(HiddenStateStore.open(path)) == 40 - len(ids)


def test_concurrent_writer_processes_and_a_refreshing_reader(tmp_path):
    path = tmp_path / "store"
    HiddenStateStore.create(path, HEADER)
    reader = HiddenStateStore.open(path)
    procs = [spawn(path, f"node{k}", 100 * k, 100 * k + 60) for k in range(3)]
    seen = 0
    while any(p.poll() is None for p in procs):
        reader.refresh()
        assert len(reader) >= seen
        seen = len(reader)
        for sid in reader.sample_ids()[-3:]:
            assert reader.read(sid, verify=True).sample_id == sid
        time.sleep(0.02)
    for p in procs:
        finish(p)
    reader.refresh()
    store = check_store(path, {f"s{100 * k + i}" for k in range(3) for i in range(60)})
    stats = store.stats()
    assert stats["samples"] == 180 and stats["writers"] == 3 and stats["duplicates"] == 0
    assert reader.sample_ids() == store.sample_ids()


def test_concurrent_create_agrees_on_one_header(tmp_path):
    path = tmp_path / "store"
    procs = [spawn(path, f"c{k}", 10 * k, 10 * k + 5) for k in range(4)]
    for p in procs:
        finish(p)
    assert len(check_store(path, set())) == 20
    assert [p.name for p in path.iterdir() if p.name.startswith(".")] == []
