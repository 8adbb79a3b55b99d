"""``--max-steps`` beyond the data: the schedule spans the steps that run, so the LR decays."""

from __future__ import annotations

import json

from _train_util import small_config

from spectrain.train.loop import train


def test_the_schedule_ends_with_the_data(tiny_store, tiny_model_dir, tmp_path, caplog):
    cfg = small_config(tiny_store, tiny_model_dir, tmp_path / "run", max_steps=500, schedule="linear",
                       log_every=1)  # fmt: skip
    with caplog.at_level("WARNING"):
        summary = train(cfg)
    steps = summary["step"]
    assert 5 < steps < 500
    assert any("--max-steps 500 is beyond the data" in r.getMessage() for r in caplog.records)
    lrs = [json.loads(x)["lr"] for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert lrs[-1] < 0.05 * max(lrs)  # decayed to (nearly) min_lr at the last step, not stuck near the peak
    state = json.loads((tmp_path / "run" / (tmp_path / "run" / "latest").read_text().strip() / "trainer" /
                        "train_config.json").read_text())  # fmt: skip
    assert state["loop"]["total_steps"] == steps
