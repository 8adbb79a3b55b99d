"""Stores shared by several writers: one generator per rank, unique counts, duplicates reclaimed,
damaged manifests repaired (issue 13, point 10)."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import numpy as np
import pytest
from click.testing import CliRunner
from fake_vllm import FakeConfig, FakeVLLM

from hsgen.cli.store import gc, status, verify
from hsgen.store import HiddenStateStore, StoreHeader

HEADER = StoreHeader("fake-model", (1, 2, 4), 8, "float32")


def sample(i: int, n: int = 4):
    hidden = np.full((n, 3, 8), i, dtype=np.float32)
    return f"s{i:03d}", hidden, np.arange(n) + i, np.ones(n, dtype=np.uint8)


def fill(store, writer_id, ids, shard_bytes=4 * 3 * 8 * 4 * 5):
    with store.writer(writer_id, shard_bytes=shard_bytes) as w:
        for i in ids:
            w.add(*sample(i))


def cli_json(cmd, *args):
    r = CliRunner().invoke(cmd, [*map(str, args), "--json"])
    assert r.exit_code in (0, 1), r.output
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_status_counts_unique_samples_and_gc_reclaims_duplicates(tmp_path):
    store = HiddenStateStore.create(tmp_path / "st", HEADER)
    fill(store, "a", range(10))  # two shards of 5
    fill(store, "b", range(5, 15))  # 5..9 again: one shard all duplicates, one without
    fill(store, "c", [2, 20, 21, 22, 23])  # one shard partly duplicate
    assert cli_json(status, tmp_path / "st")["samples"] == 19
    before = cli_json(status, tmp_path / "st")["bytes"]
    out = cli_json(gc, tmp_path / "st")
    assert out["duplicates_removed"] == 6 and out["duplicates_kept"] == 0
    st = HiddenStateStore.open(tmp_path / "st")
    s = st.stats()
    assert s["samples"] == 19 and s["duplicates"] == 0 and s["bytes"] < before
    assert st.verify() == []
    for i in [*range(15), 20, 21, 22, 23]:
        got = st.read(f"s{i:03d}")
        assert np.all(got.hidden_states == i) and got.token_ids.tolist() == list(np.arange(4) + i)
    assert cli_json(gc, tmp_path / "st")["duplicates_removed"] == 0


def _corrupt_line(manifest, pick):
    lines = manifest.read_bytes().split(b"\n")
    k = pick(lines)
    lines[k] = lines[k][: len(lines[k]) // 2]  # a bad line in the middle, not a torn tail
    manifest.write_bytes(b"\n".join(lines))


@pytest.mark.parametrize("damaged", ["add", "commit"])
def test_bad_manifest_line_status_and_verify_agree_and_repair_keeps_every_sample(tmp_path, damaged):
    store = HiddenStateStore.create(tmp_path / "st", HEADER)
    fill(store, "w", range(10))  # shards of 5: lines 0-4 add, 5 commit, 6-10 add, 11 commit
    manifest = tmp_path / "st" / "manifests" / "w.jsonl"
    want = {"add": 2, "commit": 5}[damaged]
    _corrupt_line(manifest, lambda lines: want)
    st = cli_json(status, tmp_path / "st")
    ver = cli_json(verify, tmp_path / "st")
    assert st["samples"] == ver["samples"] == {"add": 9, "commit": 5}[damaged]
    assert st["manifest_problems"] >= 1 and not ver["ok"]
    plain = cli_json(gc, tmp_path / "st")
    assert plain["removed_uncommitted"] == 0, "a shard whose commit line is damaged is not garbage"
    out = cli_json(gc, tmp_path / "st", "--repair")
    assert out["repaired_manifests"] == 1 and out["dropped_samples"] == 0
    assert cli_json(status, tmp_path / "st")["samples"] == 10
    ver = cli_json(verify, tmp_path / "st")
    assert ver["ok"] and ver["samples"] == 10
    reopened = HiddenStateStore.open(tmp_path / "st")
    for i in range(10):
        assert np.all(reopened.read(f"s{i:03d}").hidden_states == i)


def test_repair_drops_a_corrupt_sample_and_keeps_the_rest(tmp_path):
    store = HiddenStateStore.create(tmp_path / "st", HEADER)
    fill(store, "w", range(5))
    shard = tmp_path / "st" / store.record("s001").shard
    data = shard / "hidden_states" / "c" / "0" / "0" / "0"
    raw = bytearray(data.read_bytes())
    rec = store.record("s001")
    raw[rec.offset * 3 * 8 * 4 + 5] ^= 0xFF
    data.write_bytes(bytes(raw))
    _corrupt_line(tmp_path / "st" / "manifests" / "w.jsonl", lambda lines: 3)
    out = cli_json(gc, tmp_path / "st", "--repair")
    assert out["dropped_samples"] == 1
    st = HiddenStateStore.open(tmp_path / "st")
    assert sorted(st.sample_ids()) == ["s000", "s002", "s003", "s004"] and st.verify() == []


def _generate(data, store, url, shared, *extra):
    args = [
        sys.executable,
        "-m",
        "hsgen.cli",
        "generate",
        str(data),
        "--store",
        str(store),
        "--endpoint",
        url,
    ]
    args += [
        "--shared-dir",
        str(shared),
        "--layer-ids",
        "1,2,4",
        "--no-progress",
        "--shard-mb",
        "0.01",
        *extra,
    ]
    return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _stored(path) -> int:
    try:
        return len(HiddenStateStore.open(path))
    except Exception:  # not created yet
        return 0


def test_second_generator_on_the_same_rank_is_refused(tmp_path):
    shared, store = tmp_path / "shm", tmp_path / "st"
    data = tmp_path / "d.jsonl"
    n = 200
    data.write_text("".join(json.dumps({"id": f"p{i}", "input_ids": [i + 1, 2, 3]}) + "\n" for i in range(n)))
    # The server stays slow until the second generator has been refused, so the first is still
    # running however long the second takes to start on a loaded machine; then it speeds up.
    cfg = FakeConfig(str(shared), capacity=2, step_s=0.04)
    with FakeVLLM(cfg).in_thread() as url:
        first = _generate(data, store, url, shared, "--commit-interval", "0.2")
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline and _stored(store) < 10:
            time.sleep(0.1)
        cfg.step_s = 1.0
        assert first.poll() is None, "the first generator must still be running"
        second = _generate(data, store, url, shared)
        out2, err2 = second.communicate(timeout=600)
        assert first.poll() is None, "the first generator must still be running"
        cfg.step_s = 0.01
        out1, err1 = first.communicate(timeout=600)
        ranked = [
            _generate(data, tmp_path / "st2", url, shared, "--world-size", "2", "--rank", r) for r in "01"
        ]
        results = [p.communicate(timeout=600) for p in ranked]
    assert first.returncode == 0, err1
    assert second.returncode == 1
    lines = [line for line in err2.splitlines() if line.strip()]
    assert len(lines) == 1 and "already being filled by rank 0" in lines[0], err2
    st = HiddenStateStore.open(store)
    assert len(st) == n and st.stats()["duplicates"] == 0
    assert [p.returncode for p in ranked] == [0, 0], [e for _, e in results]
    st2 = HiddenStateStore.open(tmp_path / "st2")
    assert len(st2) == n and st2.stats()["duplicates"] == 0
