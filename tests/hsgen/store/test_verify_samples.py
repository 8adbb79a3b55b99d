"""``hsgen verify`` names the samples a damage costs, and checks the values (issue 21, hole 6).

Before: a truncated hidden-state file, a deleted shard directory or a shard table whose checksum
changed gave one line naming only the shard, and NaN/inf stored under a valid checksum passed.
"""

from __future__ import annotations

import json
import shutil

import ml_dtypes
import numpy as np
import pytest
from click.testing import CliRunner

from hsgen.cli import main
from hsgen.store import HiddenStateStore, StoreHeader
from hsgen.store.synthetic import make_sample

HEADER = StoreHeader(verifier="tiny", layer_ids=(1, 2), hidden_size=16, dtype="bfloat16")


def make_store(path, header=HEADER, n=12) -> HiddenStateStore:
    store = HiddenStateStore.create(path, header)
    with store.writer("w", shard_bytes=40 * header.row_bytes, chunk_bytes=256) as w:
        for i in range(n):
            s = make_sample(header, f"s{i}", 5 + i % 4)
            w.add(s.sample_id, s.hidden_states, s.token_ids, s.loss_mask)
    return HiddenStateStore.open(path)


def samples_of(store: HiddenStateStore, shard: str) -> list[str]:
    return [sid for sid in store.sample_ids() if store.record(sid).shard == shard]


def verify(path) -> tuple[int, dict]:
    res = CliRunner().invoke(main, ["verify", "--json", str(path)], catch_exceptions=False)
    return res.exit_code, json.loads(res.output)


def assert_names_exactly(out: dict, named: list[str], store: HiddenStateStore) -> None:
    assert out["ok"] is False
    text = "\n".join(out["problems"])
    for sid in store.sample_ids():
        assert (f"sample {sid!r}" in text) == (sid in named), (sid, text)
    assert sorted(out["samples_affected"]) == sorted(named)


def test_a_truncated_hidden_state_file_names_its_samples(tmp_path):
    store = make_store(tmp_path / "s")
    shard = store.record("s4").shard
    data = tmp_path / "s" / shard / "hidden_states" / "c" / "0" / "0" / "0"
    with open(data, "r+b") as f:
        f.truncate(data.stat().st_size // 2)
    code, out = verify(tmp_path / "s")
    assert code == 1
    assert_names_exactly(out, samples_of(store, shard), store)
    assert any("bytes, expected" in p for p in out["problems"])


def test_a_deleted_shard_directory_names_its_samples(tmp_path):
    store = make_store(tmp_path / "s")
    shard = store.record("s7").shard
    victims = samples_of(store, shard)
    assert 1 < len(victims) < len(store)
    shutil.rmtree(tmp_path / "s" / shard)
    code, out = verify(tmp_path / "s")
    assert code == 1
    assert_names_exactly(out, victims, store)
    assert any("missing" in p for p in out["problems"])


def test_a_changed_checksum_in_the_shard_table_names_the_sample(tmp_path):
    store = make_store(tmp_path / "s")
    rec = store.record("s5")
    meta_path = tmp_path / "s" / rec.shard / "zarr.json"
    meta = json.loads(meta_path.read_text())
    table = meta["attributes"]["hsgen"]["samples"]
    row = next(r for r in table if r[0] == "s5")
    row[3] = "0" * len(row[3])
    meta_path.write_text(json.dumps(meta))
    code, out = verify(tmp_path / "s")
    assert code == 1
    assert_names_exactly(out, ["s5"], store)


def test_a_changed_checksum_in_the_manifest_names_the_sample(tmp_path):
    make_store(tmp_path / "s")
    manifest = tmp_path / "s" / "manifests" / "w.jsonl"
    lines = manifest.read_bytes().split(b"\n")
    k = next(i for i, line in enumerate(lines) if b'"id":"s2"' in line)
    rec = json.loads(lines[k])
    rec["checksum"] = rec["checksum"][:-4] + ("0000" if not rec["checksum"].endswith("0000") else "1111")
    lines[k] = json.dumps(rec, separators=(",", ":")).encode()
    manifest.write_bytes(b"\n".join(lines))
    code, out = verify(tmp_path / "s")
    assert code == 1
    assert_names_exactly(out, ["s2"], HiddenStateStore.open(tmp_path / "s"))


NON_FINITE = [float("nan"), float("inf"), float("-inf")]


@pytest.mark.parametrize("codec", ["raw", "lz4"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("bad", NON_FINITE, ids=["nan", "inf", "-inf"])
def test_non_finite_values_under_a_valid_checksum_are_found(tmp_path, dtype, codec, bad):
    header = StoreHeader(verifier="tiny", layer_ids=(1, 2), hidden_size=16, dtype=dtype, codec=codec)
    logical = {"bfloat16": ml_dtypes.bfloat16, "float16": np.float16, "float32": np.float32}[dtype]
    store = HiddenStateStore.create(tmp_path / "s", header)
    with store.writer("w", shard_bytes=40 * header.row_bytes, chunk_bytes=256) as w:
        for i in range(6):
            s = make_sample(header, f"s{i}", 6)
            hidden = s.hidden_states.view(logical).copy()
            if i == 3:
                hidden[2, 1, 5] = bad
            w.add(s.sample_id, hidden.view(header.storage_dtype), s.token_ids, s.loss_mask)
    store = HiddenStateStore.open(tmp_path / "s")
    code, out = verify(tmp_path / "s")
    assert code == 1, out
    assert_names_exactly(out, ["s3"], store)
    assert any("not finite" in p and "'s3'" in p for p in out["problems"])


def test_fp8_bit_patterns_that_are_not_finite_are_counted():
    """The fp8 writer refuses non-finite input, so a stored NaN comes only from damage: e4m3fn's
    NaN codes (0x7F, 0xFF) and a non-finite scale are counted, every other code is finite."""
    from hsgen.store.verify import non_finite_count

    codes = np.arange(256, dtype=np.uint8)
    finite = np.isfinite(codes.view(ml_dtypes.float8_e4m3fn).astype(np.float32))
    assert non_finite_count(codes, "bfloat16", "fp8") == int((~finite).sum()) == 2
    scale = np.array([1.0, np.inf, np.nan], dtype=np.float32)
    assert non_finite_count(codes[:4], "float32", "fp8", scale) == 2


def test_a_healthy_store_still_verifies(tmp_path):
    make_store(tmp_path / "s")
    code, out = verify(tmp_path / "s")
    assert code == 0 and out["ok"] is True and out["samples_affected"] == []
