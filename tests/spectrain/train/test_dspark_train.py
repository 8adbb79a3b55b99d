"""DSpark through the commands: ``spectrain train --speculator-type dspark`` (speculators' flags too),
its servable checkpoints, ``spectrain export`` and its refusal, ``spectrain eval`` exact."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from spectrain.cli import main


def _train(store, verifier, save, *extra):
    args = ["train", "--store", str(store), "--verifier", str(verifier), "--speculator-type", "dspark",
            "--save-path", str(save), "--total-seq-len", "256", "--max-steps", "4", "--save-every", "0",
            "--log-every", "2", "--num-workers", "0", "--val-fraction", "0.1", "--val-every", "4", "--block-size", "4",
            "--max-anchors", "16", "--num-layers", "1", "--markov-rank", "16", "--verifier-name", "org/tiny",
            *extra]  # fmt: skip
    res = CliRunner().invoke(main, args, catch_exceptions=False)
    assert res.exit_code == 0, res.output
    return json.loads(res.stdout.strip().splitlines()[-1]), save / "checkpoint-00000004"


@pytest.mark.parametrize("layout", ["anchor-first", "fill-in"])
def test_train_export_eval(tiny_store, tiny_model_dir, tmp_path, sample_chats_path, layout):
    extra = ["--loss-fn", '{"ce": 0.1, "tv": 1.8}'] + (
        ["--no-sample-from-anchor"] if layout == "fill-in" else []
    )
    summary, ckpt = _train(tiny_store, tiny_model_dir, tmp_path / "run", *extra)
    assert summary["step"] == 4
    cfg = json.loads((ckpt / "config.json").read_text())
    k = 4 if layout == "anchor-first" else 3
    assert cfg["speculators_model_type"] == "dspark" and cfg["sample_from_anchor"] is (
        layout == "anchor-first"
    )
    assert cfg["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == k
    resolved = json.loads((ckpt / "trainer" / "train_config.json").read_text())
    assert resolved["draft"]["loss_mix"] == {"ce": 0.1, "tv": 1.8}
    records = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    train_recs = [r for r in records if r["split"] == "train"]
    assert len(train_recs[-1]["acc"]) == k and 0 < train_recs[-1]["accept_rate"] < 1
    assert train_recs[-1]["expected_tau"] >= 1 and "confidence_error" in train_recs[-1]
    assert [r for r in records if r["split"] == "validation"][-1]["accept_rate"] > 0
    res = CliRunner().invoke(main, ["export", str(ckpt), str(tmp_path / "exp")])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout.strip().splitlines()[-1])["speculative_config"]["method"] == "dspark"
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(sample_chats_path.read_text().splitlines(keepends=True)[-3:]))
    res = CliRunner().invoke(main, ["eval", "--draft", str(tmp_path / "exp"), "--verifier", str(tiny_model_dir),
                                    "--prompts", str(prompts), "--max-new-tokens", "16", "--json", "--no-progress"])  # fmt: skip
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["algorithm"] == "dspark" and out["num_speculative_tokens"] == k and out["exact_match"] is True
    assert 1.0 <= out["tau"] <= k + 1


def test_a_gated_run_checkpoints_for_spectrain_and_its_export_for_vllm_is_refused(
    tiny_store, tiny_model_dir, tmp_path, caplog
):
    _, ckpt = _train(tiny_store, tiny_model_dir, tmp_path / "run", "--markov-head-type", "gated")
    assert "not in vLLM: markov_head_type gated" in caplog.text
    assert json.loads((ckpt / "config.json").read_text())["markov_head_type"] == "gated"
    res = CliRunner().invoke(main, ["export", str(ckpt), str(tmp_path / "exp")])
    assert res.exit_code == 1
    lines = [x for x in res.output.strip().splitlines() if x.startswith("Error")]
    assert len(lines) == 1 and "vLLM 0.32 serves only the vanilla Markov head" in lines[0], res.output
    res = CliRunner().invoke(main, ["export", str(ckpt), str(tmp_path / "exp"), "--allow-unservable"])
    assert res.exit_code == 0, res.output
