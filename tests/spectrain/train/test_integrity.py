"""Never train on what is not intact (issue 13, point 4).

A sample whose bytes no longer match its checksum is refused with a message naming it; a NaN
loss never reaches the optimizer nor an export: the step is skipped with a warning and counted,
and too many in a row stop the run.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from _train_util import small_config
from safetensors.torch import load_file

from hsgen.store import HiddenStateStore
from spectrain.train.loop import train


def _copy_with_nan(src, dst, nan_ids) -> HiddenStateStore:
    """A copy of store ``src`` whose samples ``nan_ids`` hold NaN (with valid checksums)."""
    old = HiddenStateStore.open(src)
    new = HiddenStateStore.create(dst, old.header)
    with new.writer("copy") as w:
        for sid in old.sample_ids():
            s = old.read(sid)
            hidden = s.hidden_states.copy()
            if sid in nan_ids:
                hidden[:] = 0x7FC0  # bfloat16 NaN
            w.add(sid, hidden, s.token_ids, s.loss_mask)
    return new


def _finite_export(ckpt) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in load_file(str(ckpt / "model.safetensors")).values())


@pytest.mark.parametrize("workers", [0, 2])
def test_a_flipped_byte_is_skipped_naming_the_sample(tiny_store, tiny_model_dir, tmp_path, caplog, workers):
    """The loader refuses the damaged sample (its slots become padding), names it, counts it; with
    DataLoader workers too (issue 33's audit: a worker's checksum failure ended the run)."""
    store = tmp_path / "store"
    shutil.copytree(tiny_store, store)
    st = HiddenStateStore.open(store)
    victim = st.sample_ids()[3]
    rec = st.record(victim)
    data = store / rec.shard / "hidden_states" / "c" / "0" / "0" / "0"
    row = st.header.row_bytes
    raw = bytearray(data.read_bytes())
    raw[rec.offset * row : rec.offset * row + 2] = np.array([0x7FC0], dtype="<u2").tobytes()  # one NaN
    data.write_bytes(bytes(raw))
    summary = train(
        small_config(store, tiny_model_dir, tmp_path / "run", val_fraction=0.0, num_workers=workers)
    )
    assert summary["samples_refused"] == 1
    assert summary["loss"] is not None and np.isfinite(summary["loss"])
    assert repr(victim) in caplog.text and "checksum" in caplog.text
    assert _finite_export(tmp_path / "run" / f"checkpoint-{summary['step']:08d}")


def test_nan_samples_are_skipped_counted_and_never_exported(tiny_store, tiny_model_dir, tmp_path, caplog):
    ids = HiddenStateStore.open(tiny_store).sample_ids()
    store = _copy_with_nan(tiny_store, tmp_path / "nan", set(ids[::12]))
    summary = train(small_config(store.path, tiny_model_dir, tmp_path / "run"))
    assert summary["nonfinite_steps_skipped"] >= 1 and summary["step"] >= 1
    assert summary["loss"] is not None and np.isfinite(summary["loss"])
    assert "not finite, the step is skipped" in caplog.text
    assert _finite_export(tmp_path / "run" / f"checkpoint-{summary['step']:08d}")
    records = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["nonfinite_steps_skipped"] == summary["nonfinite_steps_skipped"]


def test_nan_everywhere_stops_after_the_limit_without_saving(tiny_store, tiny_model_dir, tmp_path):
    ids = HiddenStateStore.open(tiny_store).sample_ids()
    store = _copy_with_nan(tiny_store, tmp_path / "nan", set(ids))
    with pytest.raises(ValueError, match="3 steps in a row") as ei:
        train(small_config(store.path, tiny_model_dir, tmp_path / "run", max_nonfinite_steps=3))
    assert type(ei.value).__name__ == "NonFiniteTraining"
    assert not list((tmp_path / "run").glob("checkpoint-*"))


@pytest.mark.timeout(900)
def test_a_run_that_refused_samples_exits_non_zero_unless_the_loss_is_accepted(
    tiny_store, tiny_model_dir, tmp_path
):
    """Issue 21, hole 6: training that refused samples exited 0; it exits 3 now, with one line,
    unless ``--accept-refused N`` bounds the loss (the summary says how many were accepted)."""
    import subprocess
    import sys

    store = tmp_path / "store"
    shutil.copytree(tiny_store, store)
    st = HiddenStateStore.open(store)
    for victim in st.sample_ids()[3:5]:  # a flipped byte in each: their checksums fail as read
        rec = st.record(victim)
        data = store / rec.shard / "hidden_states" / "c" / "0" / "0" / "0"
        raw = bytearray(data.read_bytes())
        raw[rec.offset * st.header.row_bytes] ^= 0x01
        data.write_bytes(bytes(raw))
    base = [sys.executable, "-m", "spectrain.cli", "train", "--store", str(store), "--verifier", str(tiny_model_dir),
            "--block-size", "4", "--num-layers", "1", "--max-anchors", "16", "--total-seq-len", "256",
            "--val-fraction", "0", "--epochs", "1", "--device", "cpu"]  # fmt: skip
    for accept, code in ((None, 3), ("2", 0)):
        extra = ["--accept-refused", accept] if accept else []
        save = tmp_path / f"run-{accept}"
        r = subprocess.run(
            [*base, "--save-path", str(save), *extra], capture_output=True, text=True, timeout=600
        )
        assert r.returncode == code, r.stderr[-2000:]
        summary = json.loads(r.stdout.strip().splitlines()[-1])
        assert summary["samples_refused"] == 2 and summary["refused_accepted"] == int(accept or 0)
        if code:
            last = r.stderr.strip().splitlines()[-1]
            assert "2 samples were refused" in last and "--accept-refused 2" in last, r.stderr[-2000:]


@pytest.mark.timeout(900)
def test_a_damaged_manifest_line_is_counted_as_lost_and_the_run_exits_non_zero(
    tiny_store, tiny_model_dir, tmp_path
):
    """Issue 21, hole 6: a damaged add line dropped its sample from training without a count; the
    summary counts it now (``samples_hidden``), the run exits 3 naming the way to recover it, and
    ``hsgen verify`` names the sample from the shard's own table."""
    import subprocess
    import sys

    from hsgen.store.verify import verify_report

    store = tmp_path / "store"
    shutil.copytree(tiny_store, store)
    manifest = next((store / "manifests").glob("*.jsonl"))
    lines = manifest.read_bytes().split(b"\n")
    k = next(i for i, line in enumerate(lines) if line.startswith(b'{"op":"add"'))
    victim = json.loads(lines[k])["id"]
    lines[k] = lines[k][: len(lines[k]) // 2]  # a damaged line (not the torn last one)
    manifest.write_bytes(b"\n".join(lines))
    st = HiddenStateStore.open(store)
    assert victim not in st.sample_ids() and st.samples_hidden() == 1
    assert victim in verify_report(st).samples_affected
    r = subprocess.run(
        [sys.executable, "-m", "spectrain.cli", "train", "--store", str(store), "--verifier", str(tiny_model_dir),
         "--block-size", "4", "--num-layers", "1", "--max-anchors", "16", "--total-seq-len", "256",
         "--val-fraction", "0", "--epochs", "1", "--device", "cpu", "--save-path", str(tmp_path / "run")],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert r.returncode == 3, r.stderr[-2000:]
    summary = json.loads(r.stdout.strip().splitlines()[-1])
    assert summary["samples_hidden"] == 1 and "samples_refused" not in summary
    last = r.stderr.strip().splitlines()[-1]
    assert "1 stored samples are hidden by damaged manifest lines" in last and "--accept-refused 1" in last, (
        last
    )


@pytest.mark.parametrize("workers", [0, 2])
def test_a_truncated_chunk_warns_naming_store_shard_and_each_sample(
    tiny_store, tiny_model_dir, tmp_path, caplog, workers
):
    """Issue 33: a token_ids chunk cut short warned 'store X: file ends at byte N, M bytes short'
    with no shard and no sample id, while ``hsgen verify`` named the samples; each warning names
    the store, the shard and the sample now, the same samples verify names. With DataLoader
    workers (``--num-workers 2``) the same chunk ended the run with a worker's traceback (the
    audit): the refusal now travels to the main process, which counts and warns."""
    from hsgen.store.verify import verify_report

    store = tmp_path / "store"
    shutil.copytree(tiny_store, store)
    st = HiddenStateStore.open(store)
    ids = st.sample_ids()
    shard = st.record(ids[-1]).shard
    last = [sid for sid in ids if st.record(sid).shard == shard][-2:]
    chunk = store / shard / "token_ids" / "c" / "0"
    cut = 8 * st.record(last[1]).length + 4  # all of the last sample's ids and half of one of the one before
    chunk.write_bytes(chunk.read_bytes()[:-cut])
    damaged = set(verify_report(HiddenStateStore.open(store)).samples_affected)
    assert damaged == set(last)
    summary = train(small_config(store, tiny_model_dir, tmp_path / "run", num_workers=workers))
    assert summary["samples_refused"] == 2
    warned = [r.getMessage() for r in caplog.records if "skipped, not trained" in r.getMessage()]
    assert warned, caplog.text
    for line in warned:
        assert str(store) in line and shard in line, line
        assert any(repr(sid) in line for sid in damaged), line
    assert {sid for sid in damaged if any(repr(sid) in line for line in warned)} == damaged


def test_a_sample_whose_shard_was_deleted_is_skipped_naming_the_store_and_why(tiny_store, tmp_path, caplog):
    """Issue 33: every skip warning names the store and the sample; one whose shard is gone says so
    (no shard holds it any more) instead of naming none."""
    from spectrain.data.sources import StoreSource

    store = tmp_path / "store"
    shutil.copytree(tiny_store, store)
    src = StoreSource(store, val_fraction=0.0)
    sid = src.ids()[0]
    HiddenStateStore.open(store).delete_shard(src.store.record(sid).shard)
    src.store.refresh()
    assert src.locate(sid) is None and src.get(sid) is None
    warned = [r.getMessage() for r in caplog.records if "skipped, not trained" in r.getMessage()]
    assert len(warned) == 2, caplog.text
    for line in warned:
        assert line.startswith(f"store {store}: sample {sid!r}") and "its shard was deleted" in line, line
