"""Helpers of the real-vLLM tier: chat files, CLI runs as separate processes, relative errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

LAYERS = [1, 2, 3, 4]
"""Layer ids the extraction server writes: 1..3 feed the drafts, 4 (the last, pre-norm) the targets."""


def env() -> dict[str, str]:
    out = dict(os.environ)
    out.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    return out


def write_chats(sample_chats_path: Path, path: Path, n: int, start: int = 0) -> list[str]:
    """The sample chats ``start .. start+n`` as a JSONL file; returns their ids."""
    lines = Path(sample_chats_path).read_text().splitlines()[start : start + n]
    path.write_text("\n".join(lines) + "\n")
    return [json.loads(x)["id"] for x in lines]


def generate_cmd(
    data: Path, store: Path, url: str, shared: Path, model: Path, layers, *extra: str
) -> list[str]:
    return [
        sys.executable, "-m", "hsgen.cli", "generate", str(data), "--store", str(store), "--endpoint", url,
        "--shared-dir", str(shared), "--layer-ids", ",".join(map(str, layers)), "--tokenizer", str(model),
        "--max-len", "512", "--no-progress", "--log-level", "WARNING", *extra,
    ]  # fmt: skip


def run_json(cmd: list[str], timeout: float = 600) -> tuple[subprocess.CompletedProcess, dict | None]:
    """Run a CLI; returns the process and its last stdout line parsed as JSON (None if absent)."""
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env())
    lines = r.stdout.strip().splitlines()
    try:
        return r, json.loads(lines[-1]) if lines else None
    except json.JSONDecodeError:
        return r, None


def rel_err(a, b) -> float:
    """``max|a - b| / max|b|`` in float64."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


def consumed_ids(save: Path) -> dict[int, list[str]]:
    """Sample ids trained per epoch, from the online source's record (a run without a crash)."""
    out: dict[int, list[str]] = {}
    for line in (save / "online-consumed-rank0.jsonl").read_text().splitlines():
        rec = json.loads(line)
        out.setdefault(rec["epoch"], []).extend(rec["ids"])
    return out


def last_data_metrics(save: Path) -> dict:
    recs = [json.loads(x) for x in (save / "metrics.jsonl").read_text().splitlines()]
    return [r["data"] for r in recs if "data" in r][-1]


def assert_alive(server) -> None:
    """Fail with the server's log when it died (a dead engine fails every later request anyway)."""
    assert server.alive(), f"vLLM died:\n{server.log_tail()}"
