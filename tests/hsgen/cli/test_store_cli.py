"""``hsgen status|verify|gc`` on real stores."""

from __future__ import annotations

import json
import shutil

from click.testing import CliRunner

from hsgen.cli import main
from hsgen.store import HiddenStateStore, StoreHeader
from hsgen.store.synthetic import make_sample

HEADER = StoreHeader(verifier="tiny", layer_ids=(1, 3), hidden_size=32, dtype="bfloat16")


def make_store(path, n=12, writers=2):
    store = HiddenStateStore.create(path, HEADER)
    for k in range(writers):
        with store.writer(f"w{k}", shard_bytes=20 * HEADER.row_bytes) as w:
            for i in range(n):
                s = make_sample(HEADER, f"{k}-{i}", 3 + i)
                w.add(s.sample_id, s.hidden_states, s.token_ids, s.loss_mask)
    return store


def run(*args):
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


def test_status_text_and_json(tmp_path):
    store = make_store(tmp_path / "s")
    res = run("status", tmp_path / "s")
    assert res.exit_code == 0
    assert "samples      24" in res.output and "writers      2" in res.output and "bytes/token" in res.output
    res = run("status", "--json", tmp_path / "s")
    data = json.loads(res.output)
    tokens = 2 * sum(3 + i for i in range(12))
    assert data["samples"] == 24 and data["tokens"] == tokens and data["writers"] == 2
    assert data["shards"] == len(store.shards()) and data["bytes"] > tokens * HEADER.row_bytes
    assert abs(data["bytes_per_token"] - data["bytes"] / tokens) < 1e-9


def test_status_reads_manifests_only(tmp_path):
    make_store(tmp_path / "s")
    shutil.rmtree(tmp_path / "s" / "shards")
    data = json.loads(run("status", "--json", tmp_path / "s").output)
    assert data["samples"] == 24


def test_verify_ok_then_lists_failures_and_exits_non_zero(tmp_path):
    store = make_store(tmp_path / "s")
    res = run("verify", tmp_path / "s")
    assert res.exit_code == 0 and "24 samples checked, 0 problems: OK" in res.output
    rec = store.record("1-5")
    target = tmp_path / "s" / rec.shard / "loss_mask" / "c" / "0"
    data = bytearray(target.read_bytes())
    data[rec.offset] ^= 1
    target.write_bytes(bytes(data))
    res = run("verify", tmp_path / "s")
    assert res.exit_code == 1
    assert "FAIL" in res.output and "'1-5'" in res.output and "1 problems" in res.output
    res = run("verify", "--json", tmp_path / "s")
    out = json.loads(res.output)
    assert res.exit_code == 1 and out["ok"] is False and len(out["problems"]) == 1


def test_gc_json_and_text(tmp_path):
    store = make_store(tmp_path / "s")
    victim = next(iter(store.shards()))
    store.delete_shard(victim)
    (tmp_path / "s" / "shards" / "w0" / "00000050.zarr.tmp-aa").mkdir()
    (tmp_path / "s" / "shards" / "w0" / "00000050.zarr.tmp-aa" / "x").write_bytes(b"12345")
    res = run("gc", "--dry-run", tmp_path / "s")
    assert res.exit_code == 0 and "would remove: 1 temp" in res.output
    out = json.loads(run("gc", "--json", tmp_path / "s").output)
    assert out["removed_temp"] == 1 and out["bytes_freed"] == 5 and out["dry_run"] is False
    assert not (tmp_path / "s" / "shards" / "w0" / "00000050.zarr.tmp-aa").exists()


def test_not_a_store_is_a_clear_error(tmp_path):
    for cmd in ("status", "verify", "gc"):
        res = run(cmd, tmp_path)
        assert res.exit_code != 0 and f"{tmp_path}: not an hsgen store" in res.output


def test_status_fast_matches_exact_and_exact_counts_duplicates_once(tmp_path):
    store = make_store(tmp_path / "s")
    store.delete_shard(next(iter(store.shards())))
    fast = json.loads(run("status", "--json", "--fast", tmp_path / "s").output)
    exact = json.loads(run("status", "--json", tmp_path / "s").output)
    assert fast["exact"] is False and exact["exact"] is True
    for key in ("samples", "tokens", "bytes", "shards", "writers", "deleted_shards"):
        assert fast[key] == exact[key], key
    assert "1-0" in store
    s = make_sample(HEADER, "1-0", 3)
    with store.writer("dup") as w:
        w.add("1-0", s.hidden_states, s.token_ids)
    fast = json.loads(run("status", "--json", "--fast", tmp_path / "s").output)
    exact = json.loads(run("status", "--json", tmp_path / "s").output)
    assert fast["samples"] == exact["samples"] + 1 and exact["duplicates"] == 1
    assert "duplicates   1" in run("status", tmp_path / "s").output
