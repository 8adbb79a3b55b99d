"""``spectrain report``: charts from a real tiny run's metrics.jsonl, checked by opening the PNGs."""

from __future__ import annotations

import base64
import json
import re
from pathlib import Path

import matplotlib.image as mpimg
import pytest
from click.testing import CliRunner

from spectrain.train.loop import TrainConfig, train


@pytest.fixture(scope="module")
def tiny_run(tiny_store, tiny_model_dir, tmp_path_factory):
    """A real 2-epoch DFlash run on the tiny store, validated every 3 steps."""
    save = tmp_path_factory.mktemp("report") / "run"
    cfg = TrainConfig(
        store=str(tiny_store), verifier=str(tiny_model_dir), save_path=str(save), speculator_type="dflash",
        draft={"block_size": 4, "max_anchors": 16, "num_layers": 1}, total_seq_len=256, epochs=2, lr=3e-3,
        save_every=0, log_every=1, val_fraction=0.1, val_every=3, seed=1, warmup_steps=2,
    )  # fmt: skip
    summary = train(cfg)
    return save, summary


EVAL = {"draft": "d", "algorithm": "dflash", "tau": 1.75, "steps": 40, "num_prompts": 4, "exact_match": True,
        "accepted_histogram": [20, 10, 6, 4], "acceptance_rate": [0.5, 0.25, 0.1]}  # fmt: skip


def test_report_renders_every_chart_from_a_real_run(tiny_run):
    from spectrain.cli import main

    save, summary = tiny_run
    records = [json.loads(line) for line in (save / "metrics.jsonl").read_text().splitlines()]
    assert any(r["split"] == "validation" for r in records) and any(r["split"] == "train" for r in records)
    (save / "eval.json").write_text("some table line\n" + json.dumps(EVAL) + "\n")  # found without --eval
    res = CliRunner().invoke(main, ["report", str(save)], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout.strip().splitlines()[-1])
    names = [p.rsplit("/", 1)[-1] for p in out["png"]]
    assert names == [
        "loss_lr.png",
        "position_accuracy.png",
        "tau.png",
        "throughput.png",
        "eval_acceptance.png",
    ]
    assert out["records"] == len({(r["split"], r["step"]) for r in records})
    page = (save / "report" / "index.html").read_text()
    embedded = dict(re.findall(r'src="data:image/png;base64,([^"]+)"[^>]*data-file="([^"]+)"', page))
    embedded = {name: data for data, name in embedded.items()}
    assert sorted(embedded) == sorted(names)
    for path in out["png"]:
        img = mpimg.imread(path)
        assert img.shape[:2] == (450, 800), path  # FIGSIZE * DPI
        assert img[..., :3].std() > 0.05, f"{path} is blank"
        name = path.rsplit("/", 1)[-1]
        assert base64.b64decode(embedded[name]) == Path(path).read_bytes()  # the page is self-contained
    assert f"last step</td><td>{summary['step']} (epoch 2 of 2)" in page  # the last step is logged
    assert [r["step"] for r in records if r["split"] == "train"][-1] == summary["step"]
    assert "tau 1.750 on 4 prompts" in page
    assert "Training accuracy per draft position (teacher-forced)" in page and "measured acceptance" in page
    assert "<h2>Hyperparameters</h2>" in page and "<td>lr</td><td>0.003</td>" in page
    assert "<td>draft.block_size</td><td>4</td>" in page


def test_report_keeps_the_later_record_of_a_resumed_step(tmp_path):
    from spectrain.eval.report import read_metrics

    lines = [{"split": "train", "step": 1, "loss": 3.0}, {"split": "train", "step": 2, "loss": 2.5},
             {"split": "train", "step": 2, "loss": 2.0}, {"split": "validation", "step": 2, "tau": 1.2}]  # fmt: skip
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in lines) + '\n{"split": "tr')
    m = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["loss"] for r in m.train] == [3.0, 2.0]
    assert [r["tau"] for r in m.validation] == [1.2]
    assert m.bad_lines == 1


def test_report_errors_name_the_file(tmp_path):
    from spectrain.cli import main

    res = CliRunner().invoke(main, ["report", str(tmp_path)])
    assert res.exit_code == 1 and "metrics.jsonl: not found" in res.output
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"split": "train", "step": 1, "loss": 1.0}) + "\n")
    bad = tmp_path / "e.json"
    bad.write_text("{}")
    res = CliRunner().invoke(main, ["report", str(tmp_path), "--eval", str(bad)])
    assert res.exit_code == 1 and "e.json: not a spectrain eval --json output" in res.output


def test_missing_matplotlib_gives_the_install_hint(tmp_path, monkeypatch):
    import sys

    from spectrain.eval.report import ReportError, write_report

    (tmp_path / "metrics.jsonl").write_text(json.dumps({"split": "train", "step": 1, "loss": 1.0}) + "\n")
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    with pytest.raises(ReportError, match="pip install matplotlib"):
        write_report(tmp_path)
