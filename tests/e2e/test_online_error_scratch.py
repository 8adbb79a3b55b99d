"""An online run that fails leaves no scratch store behind (a stopped one keeps it to resume)."""

from __future__ import annotations

import subprocess
import sys

from hsgen.serve.testing import running_server


def test_an_error_exit_removes_the_scratch_store(tmp_path, tiny_model_dir, sample_chats_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(sample_chats_path.read_text().splitlines()[:24]) + "\n")
    scratch = tmp_path / "scratch"
    with running_server(tiny_model_dir, "1,2,4", tmp_path / "shm") as url:

        def run(*extra):
            return subprocess.run([
                sys.executable, "-m", "spectrain.cli", "train", "--online", "--endpoint", url, "--prompts",
                str(prompts), "--verifier", str(tiny_model_dir), "--save-path", str(tmp_path / "save"),
                "--shared-dir", str(url.shared_dir), "--scratch-dir", str(scratch), "--online-option",
                "layer_ids=[1,2,4]", "--total-seq-len", "256", "--num-layers", "1", "--max-anchors", "16",
                "--val-fraction", "0", "--device", "cpu", "--no-progress", *extra], capture_output=True, text=True,
                timeout=400)  # fmt: skip

        first = run("--block-size", "4", "--max-steps", "2")
        assert first.returncode == 0, first.stderr[-2000:]
        assert scratch.is_dir() and any(scratch.iterdir())  # kept: the samples not trained yet, for a resume
        refused = run("--block-size", "8", "--max-steps", "3")
        assert refused.returncode == 1 and "block_size (4 -> 8)" in refused.stderr
        assert not scratch.exists(), "the failed run left its scratch store"
