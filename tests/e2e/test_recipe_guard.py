"""The recipe guard's verdict (``scripts/bench_recipe_guard.py``, issue 31): against the record for
the same input hashes a tau under 90% of it fails; without one, the size's record on other inputs
judges at 70%, and the hashes that differ are named; with no record at all it says how to make one.
The guard's run itself is the CI smoke's (``scripts/bench_smoke.py`` finds it); docs/benchmarks.md
shows it failing on broken recipes."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import bench_recipe_guard as guard  # noqa: E402
import bench_smoke  # noqa: E402

INPUTS = {"target_weights_sha256": "w", "train_jsonl_sha256": "t", "eval_jsonl_sha256": "e"}
RECORD = {"inputs": INPUTS, "recorded": "2026-12-05", "tau_dflash": 3.0, "tau_eagle3": 4.0}


def _figures(dflash: float, eagle3: float, **inputs) -> dict:
    return {**INPUTS, **inputs, "tau_dflash": dflash, "tau_eagle3": eagle3}


def test_the_same_inputs_are_judged_against_their_record_at_90_percent():
    ok = guard._judge(_figures(2.71, 3.61), [RECORD])
    assert ok == {"inputs_recorded": True, "recorded": {"dflash": 3.0, "eagle3": 4.0},
                  "floors": {"dflash": 2.7, "eagle3": 3.6}, "fell": []}  # fmt: skip
    assert guard._judge(_figures(2.69, 4.5), [RECORD])["fell"] == ["dflash"]


def test_other_inputs_fall_back_to_the_sizes_record_at_70_percent(capsys):
    verdict = guard._judge(_figures(2.2, 2.7, train_jsonl_sha256="other"), [RECORD])
    assert not verdict["inputs_recorded"] and verdict["floors"] == {"dflash": 2.1, "eagle3": 2.8}
    assert verdict["fell"] == ["eagle3"]
    assert "train_jsonl_sha256 differ" in capsys.readouterr().err


def test_no_record_at_all_says_how_to_make_one():
    with pytest.raises(SystemExit, match="no recorded figure for the guard size; run with --record"):
        guard._judge(_figures(3.0, 4.0), [])


def test_the_ci_smoke_runs_the_guard_and_a_record_exists_for_it():
    assert bench_smoke.benchmarks()["bench_recipe_guard"][1:] == ["--quick"]
    assert guard._records() and all(
        {"inputs", "tau_dflash", "tau_eagle3"} <= set(r) for r in guard._records()
    )
