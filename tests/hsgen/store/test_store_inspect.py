"""``hsgen stats`` and ``hsgen show``: statistics and one sample, checked against the written arrays."""

from __future__ import annotations

import json

import ml_dtypes
import numpy as np
import pytest
from click.testing import CliRunner

from hsgen.cli import main
from hsgen.store import HiddenStateStore, StoreHeader

LENGTHS = {"a": 10, "b": 40, "c": 70, "d": 300}
MASKS = {"a": [0] * 10, "b": [0] * 20 + [1] * 20, "c": [1] * 70, "d": [0, 1] * 150}


@pytest.fixture
def store(tmp_path, tiny_model_dir):
    from hsgen.inputs.render import ChatRenderer, RenderConfig

    fp = ChatRenderer(RenderConfig(tokenizer_path=str(tiny_model_dir))).fingerprint
    header = StoreHeader(verifier=str(tiny_model_dir), layer_ids=(1, 4), hidden_size=8, dtype="bfloat16",
                         tokenizer_fingerprint=fp)  # fmt: skip
    st = HiddenStateStore.create(tmp_path / "store", header)
    rng = np.random.default_rng(0)
    arrays = {}
    for writer, ids in (("w1", ["a", "b"]), ("w2", ["c", "d"])):
        with st.writer(writer, shard_bytes=1) as w:  # one shard per sample
            for sid in ids:
                hs = rng.standard_normal((LENGTHS[sid], 2, 8)).astype(ml_dtypes.bfloat16)
                tokens = rng.integers(3, 500, LENGTHS[sid])
                w.add(sid, hs, tokens, np.asarray(MASKS[sid], np.uint8))
                arrays[sid] = (hs.astype(np.float32), tokens)
    with st.writer("w3") as w:  # a duplicate id: counted once
        w.add("a", rng.standard_normal((10, 2, 8)).astype(ml_dtypes.bfloat16), np.arange(10), None)
    st.refresh()
    return st, arrays


def test_stats(store):
    st, _ = store
    res = CliRunner().invoke(main, ["stats", str(st.path), "--json"])
    assert res.exit_code == 0, res.output
    d = json.loads(res.stdout)
    assert d["samples"] == 4 and d["tokens"] == 420
    assert d["trained_tokens"] == 0 + 20 + 70 + 150
    assert d["loss_mask_coverage"] == pytest.approx(240 / 420)
    assert d["samples_without_loss"] == 1
    assert d["length"] == {"min": 10, "mean": 105.0, "p50": 70, "p90": 300, "p99": 300, "max": 300}
    hist = {(b["min"], b["max"]): b["samples"] for b in d["length_histogram"]}
    assert hist == {(1, 16): 1, (17, 32): 0, (33, 64): 1, (65, 128): 1, (129, 256): 0, (257, 512): 1}
    assert {k: (v["samples"], v["tokens"], v["shards"]) for k, v in d["writers"].items()} == {
        "w1": (2, 50, 2), "w2": (2, 370, 2)}  # fmt: skip
    assert len(d["shards"]) == 4 and all(s["bytes"] > 0 for s in d["shards"].values())
    text = CliRunner().invoke(main, ["stats", str(st.path), "--shards", "1"]).stdout
    assert "57.1% of all; 1 samples without any" in text
    assert "257-512" in text and "... 3 more shards" in text


def test_show_decodes_and_matches_the_stored_arrays(store, tiny_model_dir):
    from tokenizers import Tokenizer

    st, arrays = store
    res = CliRunner().invoke(main, ["show", str(st.path), "b", "--json"])
    assert res.exit_code == 0, res.output
    d = json.loads(res.stdout)
    hs, tokens = arrays["b"]
    tok = Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))
    assert [t["id"] for t in d["tokens"]] == tokens.tolist()
    assert [t["mask"] for t in d["tokens"]] == MASKS["b"]
    assert [t["text"] for t in d["tokens"]] == [
        tok.decode([int(t)], skip_special_tokens=False) for t in tokens
    ]
    np.testing.assert_allclose([t["norms"] for t in d["tokens"]], np.linalg.norm(hs, axis=-1), atol=1e-3)
    assert d["layers"]["4"]["max"] == pytest.approx(float(np.linalg.norm(hs[:, 1], axis=-1).max()), rel=1e-5)
    assert d["verified"] and d["trained_tokens"] == 20 and "WARNING" not in d["tokenizer"]
    text = CliRunner().invoke(main, ["show", str(st.path), "b", "--max-tokens", "3"]).stdout
    assert "(40 tokens, 20 trained)" in text and "... 37 more tokens" in text


def test_show_errors_and_fingerprint_warning(store, tmp_path, tiny_model_dir):
    import shutil

    st, _ = store
    res = CliRunner().invoke(main, ["show", str(st.path), "nope"])
    assert res.exit_code == 1 and "sample 'nope' is not in store" in res.output
    other = tmp_path / "other-tok"
    shutil.copytree(tiny_model_dir, other)
    (other / "chat_template.jinja").write_text("{{ messages }}")
    res = CliRunner().invoke(main, ["show", str(st.path), "a", "--tokenizer", str(other), "--json"])
    assert "WARNING: fingerprint" in json.loads(res.stdout)["tokenizer"]
