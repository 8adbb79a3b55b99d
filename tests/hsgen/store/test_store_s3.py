"""A store on object storage (``s3://``) against a real S3-compatible server the tests start
(moto's server mode): the public store interface, crash safety without rename or append, and the
``hsgen status / verify / gc`` commands."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from click.testing import CliRunner

from hsgen.store import HiddenStateStore, StoreHeader
from hsgen.store.backend import ObjectBackend
from hsgen.store.fsutil import FAILPOINT_ENV


def _add(writer, ids, tokens=6):
    for i in ids:
        n = tokens + i % 5
        writer.add(f"s{i:04d}", np.full((n, 2, 8), i, np.uint16), np.arange(n) + i, np.ones(n, np.uint8))


def _check(store, ids, tokens=6):
    store.refresh()
    assert sorted(store.sample_ids()) == sorted(f"s{i:04d}" for i in ids)
    for i in ids:
        s = store.read(f"s{i:04d}")
        assert s.hidden_states.shape[0] == tokens + i % 5 and (s.hidden_states == i).all()
        assert s.token_ids[0] == i


@pytest.mark.parametrize("codec", ["raw", "lz4"])
def test_write_read_verify_delete_gc(s3_url, codec):
    header = StoreHeader("m", (1, 2), 8, "bfloat16", codec=codec)
    store = HiddenStateStore.create(s3_url, header)
    assert str(store.path) == s3_url
    with store.writer(shard_bytes=1500) as w:
        _add(w, range(20))
    again = HiddenStateStore.open(s3_url)
    _check(again, range(20))
    assert again.verify() == []
    hidden = np.zeros((7, 2, 8), np.uint16)
    ids, mask = np.zeros(7, np.int64), np.zeros(7, np.uint8)
    rec = again.read_into("s0001", hidden, ids, mask, verify=True)
    assert rec.length == 7 and (hidden == 1).all() and ids[0] == 1
    shards = again.shards()
    assert len(shards) > 1
    victim = sorted(shards)[0]
    again.delete_shard(victim)
    left = [i for i in range(20) if f"s{i:04d}" not in shards[victim]]
    _check(HiddenStateStore.open(s3_url), left)
    assert not ObjectBackend(s3_url).list(victim + "/"), "a deleted shard's objects are gone"
    with pytest.raises(Exception, match="refusing samples with a different header"):
        HiddenStateStore.create(s3_url, StoreHeader("m", (1, 3), 8, "bfloat16", codec=codec))


def test_a_corrupt_object_is_found_by_verify(s3_url):
    store = HiddenStateStore.create(s3_url, StoreHeader("m", (1, 2), 8, "bfloat16"))
    with store.writer() as w:
        _add(w, range(4))
    backend = ObjectBackend(s3_url)
    key = next(k for k in backend.list("shards/") if k.endswith("hidden_states/c/0/0/0"))
    data = bytearray(backend.get(key))
    data[10] ^= 0xFF
    backend.put(key, bytes(data))
    problems = HiddenStateStore.open(s3_url).verify()
    assert len(problems) == 1 and "s0000" in problems[0] and "checksum" in problems[0]


WRITE = """
import sys, numpy as np
from hsgen.store import HiddenStateStore, StoreHeader
st = HiddenStateStore.create(sys.argv[1], StoreHeader("m", (1, 2), 8, "bfloat16"))
lo, hi = int(sys.argv[2]), int(sys.argv[3])
with st.writer(shard_bytes=1500) as w:
    for i in range(lo, hi):
        n = 6 + i % 5
        w.add(f"s{i:04d}", np.full((n, 2, 8), i, np.uint16), np.arange(n) + i, np.ones(n, np.uint8))
"""


@pytest.mark.parametrize("point", ["shard_upload_started", "shard_uploaded"])
def test_kill_during_upload_then_resume_loses_nothing(s3_url, tmp_path, point):
    """kill -9 in the middle of a shard's upload, or after it and before its manifest segment."""
    script = tmp_path / "w.py"
    script.write_text(WRITE)
    env = {**os.environ, FAILPOINT_ENV: point}
    r = subprocess.run([sys.executable, str(script), s3_url, "0", "30"], env=env, capture_output=True)
    assert r.returncode == -9, r.stderr.decode()[-2000:]
    store = HiddenStateStore.open(s3_url)
    assert len(store) == 0 and store.verify() == [], "the half-written shard is invisible"
    backend = ObjectBackend(s3_url)
    assert any(k.startswith("shards/") for k in backend.list()), "its objects are there, orphaned"
    r = subprocess.run([sys.executable, str(script), s3_url, "0", "30"], capture_output=True)
    assert r.returncode == 0, r.stderr.decode()[-2000:]
    _check(HiddenStateStore.open(s3_url), range(30))
    out = HiddenStateStore.open(s3_url).gc(min_age_s=0)
    assert out["removed_uncommitted"] == 1 and out["bytes_freed"] > 0
    store = HiddenStateStore.open(s3_url)
    _check(store, range(30))
    assert store.verify() == []


def test_status_verify_gc_commands(s3_url):
    from hsgen.cli.store import gc, status, verify

    store = HiddenStateStore.create(s3_url, StoreHeader("m", (1, 2), 8, "bfloat16"))
    with store.writer() as w:
        _add(w, range(5))
    runner = CliRunner()
    r = runner.invoke(status, [s3_url, "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["samples"] == 5
    r = runner.invoke(verify, [s3_url, "--json", "--no-progress"])
    assert r.exit_code == 0 and json.loads(r.stdout)["ok"], r.output
    r = runner.invoke(gc, [s3_url, "--json"])
    assert r.exit_code == 0 and json.loads(r.stdout)["removed_uncommitted"] == 0, r.output
    r = runner.invoke(status, ["s3://no-such-bucket-hsgen/x"])
    assert r.exit_code != 0 and "s3://no-such-bucket-hsgen/x" in r.output
