"""A rerun into a save path whose checkpoint was shaped otherwise refuses in one line, naming
the fields and the way out; what may change on resume (steps, logging) resumes."""

from __future__ import annotations

import json

from click.testing import CliRunner

from spectrain.cli import main


def _argv(store, verifier, save, *extra):
    return ["train", "--store", str(store), "--verifier", str(verifier), "--save-path", str(save),
            "--block-size", "4", "--num-layers", "1", "--max-anchors", "16", "--total-seq-len", "256",
            "--val-fraction", "0", "--save-every", "0", "--log-every", "1", *extra]  # fmt: skip


def test_a_changed_block_size_is_refused_and_steps_may_change(tmp_path, tiny_store, tiny_model_dir):
    save = tmp_path / "run"
    first = CliRunner().invoke(main, _argv(tiny_store, tiny_model_dir, save, "--max-steps", "2"))
    assert first.exit_code == 0, first.output
    ckpt = (save / "latest").read_text().strip()

    res = CliRunner().invoke(main, [*_argv(tiny_store, tiny_model_dir, save, "--max-steps", "3"), "--block-size",
                                    "8", "--lr", "1e-3"])  # fmt: skip
    assert res.exit_code == 1
    line = res.output.strip().splitlines()[-1]
    assert line.startswith("Error: ") and ckpt in line
    assert "block_size (4 -> 8)" in line and "lr (0.0006 -> 0.001)" in line
    assert "--save-path" in line and "--resume none" in line
    assert (save / "latest").read_text().strip() == ckpt  # nothing trained, nothing written

    more = CliRunner().invoke(
        main, _argv(tiny_store, tiny_model_dir, save, "--max-steps", "3", "--log-every", "2")
    )
    assert more.exit_code == 0, more.output
    assert json.loads(more.stdout.strip().splitlines()[-1])["step"] == 3  # resumed from step 2

    fresh = CliRunner().invoke(main, [*_argv(tiny_store, tiny_model_dir, save, "--max-steps", "1"), "--block-size",
                                      "8", "--no-resume-from-checkpoint"])  # fmt: skip
    assert fresh.exit_code == 0, fresh.output
    assert json.loads(fresh.stdout.strip().splitlines()[-1])["step"] == 1
