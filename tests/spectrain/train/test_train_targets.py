"""Training from a store of target ids (``targets = "argmax"``) and from a store of today's format."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from _train_util import small_config

from spectrain.train.loop import train

OLD_STORE = Path(__file__).parents[2] / "data" / "store-format-v2"


def argmax_copy(states_store: Path, verifier_dir: Path, out: Path) -> Path:
    """A store of target ids holding the same samples: the auxiliary layers, and as targets the
    verifier's argmax of the stored last layer, computed as the trainer computes it."""
    from hsgen.store import HiddenStateStore, StoreHeader
    from spectrain.models.verifier import VerifierHeads

    src = HiddenStateStore.open(states_store)
    heads = VerifierHeads.load(verifier_dir)
    h = src.header
    header = StoreHeader(h.verifier, h.layer_ids[:-1], h.hidden_size, h.dtype, h.tokenizer_fingerprint,
                         targets="argmax")  # fmt: skip
    dst = HiddenStateStore.create(out, header)
    with dst.writer("argmax") as w, torch.no_grad():
        for sid in sorted(src.sample_ids()):
            s = src.read(sid)
            last = torch.from_numpy(np.ascontiguousarray(s.hidden_states[:, -1])).view(torch.bfloat16)
            logits = torch.nn.functional.linear(heads.norm(last.float()), heads.lm_head.float())
            w.add(sid, np.ascontiguousarray(s.hidden_states[:, :-1]), s.token_ids, s.loss_mask,
                  target_ids=logits.argmax(-1).numpy())  # fmt: skip
    return out


@pytest.fixture(scope="module")
def argmax_store(tiny_store, tiny_model_dir, tmp_path_factory) -> Path:
    return argmax_copy(tiny_store, tiny_model_dir, tmp_path_factory.mktemp("argmax") / "store")


@pytest.mark.parametrize("algorithm", ["dflash", "eagle3"])
def test_stored_argmax_trains_as_the_final_layer_does(algorithm, tiny_store, argmax_store, tiny_model_dir,
                                                      tmp_path):  # fmt: skip
    """Same samples, same seed: targets read from the store give the run that targets formed from
    the stored final layer give (hard targets are that argmax)."""
    draft = (
        {"block_size": 4, "max_anchors": 16, "num_layers": 1} if algorithm == "dflash" else {"ttt_steps": 2}
    )
    runs = {}
    for name, store in (("states", tiny_store), ("argmax", argmax_store)):
        cfg = small_config(store, tiny_model_dir, tmp_path / name, speculator_type=algorithm, draft=draft,
                           max_steps=3)  # fmt: skip
        runs[name] = train(cfg)
    a, b = runs["states"], runs["argmax"]
    assert a["step"] == b["step"] == 3
    assert b["loss"] == pytest.approx(a["loss"], rel=1e-4)
    ckpt = lambda run: next((tmp_path / run).glob("checkpoint-*")) / "model.safetensors"  # noqa: E731
    from safetensors.torch import load_file

    wa, wb = load_file(ckpt("states")), load_file(ckpt("argmax"))
    assert wa.keys() == wb.keys()
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], rtol=1e-3, atol=1e-5)


def test_a_soft_target_run_on_an_argmax_store_is_refused_in_one_line(argmax_store, tiny_model_dir, tmp_path):
    cmd = [sys.executable, "-m", "spectrain.cli", "train", "--store", str(argmax_store), "--verifier",
           str(tiny_model_dir), "--speculator-type", "dflash", "--target-mode", "soft", "--save-path",
           str(tmp_path / "run"), "--total-seq-len", "256", "--max-steps", "1", "--num-workers", "0"]  # fmt: skip
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    errors = [line for line in r.stderr.splitlines() if " INFO " not in line and line.strip()]
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert len(errors) == 1 and errors[0].startswith("Error: "), r.stderr  # log lines aside, one line
    assert "--target-mode soft needs the verifier's distribution" in errors[0]
    assert str(argmax_store) in errors[0] and "targets argmax" in errors[0]
    assert not (tmp_path / "run").exists() or not any((tmp_path / "run").glob("checkpoint-*"))


def test_a_store_of_todays_format_still_trains(tiny_model_dir, tmp_path):
    store = tmp_path / "old"
    shutil.copytree(OLD_STORE, store)
    summary = train(small_config(store, tiny_model_dir, tmp_path / "run", total_seq_len=128))
    assert summary["step"] >= 1 and np.isfinite(summary["loss"])
    assert any((tmp_path / "run").glob("checkpoint-*"))
