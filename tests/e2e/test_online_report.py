"""A 7-step online run (shorter than the default --log-every 10) leaves metrics.jsonl with its
last step, and ``spectrain report`` draws every chart from it."""

from __future__ import annotations

import json
import subprocess
import sys

import matplotlib.image as mpimg

from hsgen.serve.testing import running_server


def test_a_seven_step_online_run_reports(tmp_path, tiny_model_dir, sample_chats_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(sample_chats_path.read_text().splitlines()[:40]) + "\n")
    save = tmp_path / "save"
    with running_server(tiny_model_dir, "1,2,4", tmp_path / "shm") as url:
        r = subprocess.run([
            sys.executable, "-m", "spectrain.cli", "train", "--online", "--endpoint", url, "--prompts", str(prompts),
            "--verifier", str(tiny_model_dir), "--save-path", str(save), "--shared-dir", str(url.shared_dir),
            "--scratch-dir", str(tmp_path / "scratch"),  # not /dev/shm: a stopped run keeps what it fetched
            "--online-option", "layer_ids=[1,2,4]", "--total-seq-len", "256", "--block-size", "4",
            "--num-layers", "1", "--max-anchors", "16", "--val-fraction", "0", "--max-steps", "7",
            "--device", "cpu", "--no-progress"], capture_output=True, text=True, timeout=400)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    records = [json.loads(x) for x in (save / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in records if x["split"] == "train"] == [7]
    rep = subprocess.run([sys.executable, "-m", "spectrain.cli", "report", str(save)], capture_output=True,
                         text=True, timeout=600)  # fmt: skip
    assert rep.returncode == 0, rep.stderr
    out = json.loads(rep.stdout.strip().splitlines()[-1])
    for png in out["png"]:
        img = mpimg.imread(png)
        assert img[..., :3].std() > 0.05, f"{png} is blank"
    page = (save / "report" / "index.html").read_text()
    assert "last step</td><td>7 (epoch 1 of 1)" in page
