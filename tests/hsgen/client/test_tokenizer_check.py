"""``hsgen generate`` checks --tokenizer against each server's model before sending any work."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

from hsgen.hf.tiny import DEFAULT_SPEC, ensure_tiny_model
from hsgen.serve.testing import running_server


def _generate(prompts, store, url, tokenizer):
    args = [sys.executable, "-m", "hsgen.cli", "generate", str(prompts), "--store", str(store), "--endpoint", url,
            "--shared-dir", str(url.shared_dir), "--layer-ids", "1,2,4", "--tokenizer", str(tokenizer),
            "--no-progress", "--log-level", "WARNING"]  # fmt: skip
    return subprocess.run(args, capture_output=True, text=True, timeout=600)


def test_a_wrong_tokenizer_is_refused_before_any_request(tmp_path, tiny_model_dir, sample_chats_path):
    other = ensure_tiny_model(
        spec=dataclasses.replace(DEFAULT_SPEC, tokenizer_vocab_size=600, pretrain_steps=0)
    )
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(sample_chats_path.read_text().splitlines()[:6]) + "\n")
    with running_server(tiny_model_dir, "1,2,4", tmp_path / "shm") as url:
        wrong = _generate(prompts, tmp_path / "store", url, other)
        assert wrong.returncode == 1
        line = wrong.stderr.strip().splitlines()[-1]
        assert line.startswith("Error: --tokenizer tokenizes differently from the model") and url in line
        assert not (tmp_path / "store").exists()  # nothing was generated, nothing stored
        assert not list((tmp_path / "shm").iterdir())  # and no request reached the server
        right = _generate(prompts, tmp_path / "store", url, tiny_model_dir)
        assert right.returncode == 0, right.stderr
