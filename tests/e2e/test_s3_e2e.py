"""generate -> verify -> train through ``s3://`` against a real S3-compatible server (moto's server
mode, started by the tests) and the reference vLLM server (issue 24)."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import torch

from hsgen.serve.testing import running_server
from hsgen.store import HiddenStateStore
from spectrain.train.loop import TrainConfig, train

LAYERS = [1, 2, 3, 4]


def test_generate_verify_train_through_s3(tmp_path, sample_chats_path, tiny_model_dir, s3_url):
    data = tmp_path / "chats.jsonl"
    data.write_text("".join(sample_chats_path.read_text().splitlines(keepends=True)[:24]))
    shared = tmp_path / "shm"
    with running_server("tiny", LAYERS, shared) as url:
        args = [sys.executable, "-m", "hsgen.cli", "generate", str(data), "--store", s3_url]
        args += ["--endpoint", url, "--shared-dir", str(shared), "--layer-ids", ",".join(map(str, LAYERS))]
        args += [
            "--tokenizer",
            str(tiny_model_dir),
            "--max-len",
            "160",
            "--no-progress",
            "--shard-mb",
            "0.05",
        ]
        r = subprocess.run(args, capture_output=True, text=True, timeout=300, cwd=tmp_path)
        assert r.returncode == 0, r.stderr[-3000:]
        summary = json.loads(r.stdout.strip().splitlines()[-1])
        assert summary["stored"] == 24 and summary["store"] == s3_url
        r = subprocess.run(args, capture_output=True, text=True, timeout=300, cwd=tmp_path)
        assert r.returncode == 0 and json.loads(r.stdout.strip().splitlines()[-1])["already_done"] == 24
    store = HiddenStateStore.open(s3_url)
    assert len(store) == 24 and store.stats()["shards"] > 1
    r = subprocess.run([sys.executable, "-m", "hsgen.cli", "verify", s3_url, "--json", "--no-progress"],
                       capture_output=True, text=True, timeout=300)  # fmt: skip
    assert r.returncode == 0 and json.loads(r.stdout)["ok"], r.stdout + r.stderr[-2000:]
    torch.set_num_threads(1)
    cfg = TrainConfig(
        store=s3_url, verifier=str(tiny_model_dir), save_path=str(tmp_path / "run"), speculator_type="dflash",
        draft={"block_size": 4, "max_anchors": 16, "num_layers": 1}, total_seq_len=256, epochs=1, max_steps=3,
        lr=3e-3, save_every=0, log_every=1, val_fraction=0.0, seed=1, warmup_steps=1, read_threads=8,
    )  # fmt: skip
    out = train(cfg)
    assert out["step"] == 3 and out.get("samples_refused", 0) == 0 and np.isfinite(out["loss"])
