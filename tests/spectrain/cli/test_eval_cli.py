"""``spectrain eval``: options, table, JSON and errors."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

from spectrain.cli import main
from spectrain.export.write import export_draft
from spectrain.models import build_draft, get_config_class
from spectrain.models.verifier import VerifierHeads

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def draft_dir(tiny_model_dir, tmp_path_factory):
    torch.manual_seed(0)
    model = build_draft(
        get_config_class("dflash")(aux_layer_ids=(1, 2, 3), num_layers=1, block_size=4),
        VerifierHeads.load(tiny_model_dir),
    )
    return export_draft(model, tmp_path_factory.mktemp("cli") / "draft", verifier_name="tiny")


@pytest.fixture()
def prompts_file(tmp_path, sample_chats_path):
    rows = [json.loads(line) for line in sample_chats_path.read_text().splitlines()[:2]]
    rows.append({"id": "tok", "input_ids": [5, 6, 7, 8, 9], "loss_mask": [0, 0, 0, 1, 1]})
    rows.append({"id": "raw", "prompt": "def main():\n"})
    p = tmp_path / "prompts.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return p


def test_json_output(draft_dir, tiny_model_dir, prompts_file):
    args = ["eval", "--draft", str(draft_dir), "--verifier", str(tiny_model_dir), "--prompts", str(prompts_file),
            "--max-new-tokens", "12", "--json", "--no-progress"]  # fmt: skip
    res = CliRunner().invoke(main, args)
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["algorithm"] == "dflash" and out["num_speculative_tokens"] == 3
    assert out["num_prompts"] == 4 and out["exact_match"] is True
    assert [r["id"] for r in out["per_prompt"]] == ["stdlib-00000", "stdlib-00001", "tok", "raw"]
    assert 1.0 <= out["tau"] <= 4.0
    assert out["tau"] == pytest.approx(out["new_tokens"] / out["steps"])
    assert "tau" in res.stderr and "exact match  yes (4/4" in res.stderr


def test_table_and_options(draft_dir, tiny_model_dir, prompts_file):
    args = ["eval", "--draft", str(draft_dir), "--verifier", str(tiny_model_dir), "--prompts", str(prompts_file),
            "--max-new-tokens", "6", "--num-prompts", "1", "-k", "2", "--dtype", "float32", "--no-progress"]  # fmt: skip
    res = CliRunner().invoke(main, args)
    assert res.exit_code == 0, res.output
    assert "prompts      1 " in res.stdout
    assert "K=2" in res.stdout and "position  accepted" in res.stdout


def test_errors(draft_dir, tiny_model_dir, prompts_file, tmp_path):
    runner = CliRunner()
    res = runner.invoke(
        main,
        ["eval", "--draft", str(tmp_path), "--verifier", str(tiny_model_dir), "--prompts", str(prompts_file)],
    )
    assert res.exit_code != 0 and "config.json: not found" in res.output
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": 1, "input_ids": []}\n')
    res = runner.invoke(
        main, ["eval", "--draft", str(draft_dir), "--verifier", str(tiny_model_dir), "--prompts", str(bad)]
    )
    assert res.exit_code != 0 and "bad.jsonl:1" in res.output
    res = runner.invoke(
        main,
        [
            "eval",
            "--draft",
            str(draft_dir),
            "--verifier",
            str(tiny_model_dir),
            "--prompts",
            str(prompts_file),
            "-k",
            "9",
        ],
    )
    assert res.exit_code != 0 and "exceeds the draft's limit of 3" in res.output


def test_a_log_file_shows_each_phase_and_the_prompts_progress(
    draft_dir, tiny_model_dir, prompts_file, tmp_path
):
    """Issue 23: eval was silent in a log for its first ~100 s (the default --log-level WARNING
    hid its progress lines); now each phase has a line and the prompts their count to the total."""
    import subprocess
    import sys

    args = [sys.executable, "-m", "spectrain.cli", "eval", "--draft", str(draft_dir), "--verifier",
            str(tiny_model_dir), "--prompts", str(prompts_file), "--max-new-tokens", "6", "--json"]  # fmt: skip
    with open(tmp_path / "eval.log", "w") as log:
        r = subprocess.run(args, stderr=log, stdout=subprocess.PIPE, text=True, timeout=600)
    err = (tmp_path / "eval.log").read_text()
    assert r.returncode == 0, err
    assert "\r" not in err
    phases = ["eval: importing torch", "eval: loading the draft", "eval: loading the verifier",
              "eval: 4 prompts, up to 6 new tokens each", "eval: 4/4 prompt (100%)"]  # fmt: skip
    at = [err.find(p) for p in phases]
    assert -1 not in at and at == sorted(at), err
    quiet = subprocess.run([*args, "--no-progress"], capture_output=True, text=True, timeout=600)
    assert quiet.returncode == 0 and "eval: " not in quiet.stderr, quiet.stderr
