"""Docs that cannot rot: every ```` ```bash runnable ```` block of the tutorials runs, in the docs'
order, in one shell session (one reference server and one store shared by all of them), and
what an output block shows must appear in the block's stdout."""

from __future__ import annotations

import os
import socket
import subprocess
from pathlib import Path

import pytest
from runnable import Block, blocks, match_output

DOCS = Path(__file__).resolve().parents[2] / "docs"
ORDER = ["generate.md", "format.md", "train.md", "eval.md", "online.md"]
"""Tutorials in the order they build on each other (generate.md starts the server and the store)."""
DOC_PORT = "8011"
"""The port the tutorials' server listens on; the test swaps in a free one."""
MARK = "@@block "


def _free_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def test_runnable_blocks_are_all_in_the_order_list():
    found = {p.name for p in DOCS.glob("*.md") if blocks(p)}
    assert found == set(ORDER), f"docs with runnable blocks: {sorted(found)}; add new ones to ORDER"


def test_output_matching():
    assert match_output(["a ...", "...", "c"], "x\na 1\nb\nc\n") is None
    assert match_output(["c", "a ..."], "a 1\nc\n") == "a ..."


@pytest.mark.slow
@pytest.mark.timeout(2400)  # ~3 min idle; bounds a hang only (it passed 300 s at load 6-15)
def test_tutorials_run_as_written(tmp_path):
    todo: list[Block] = [b for name in ORDER for b in blocks(DOCS / name)]
    port = _free_port()
    script = ["set -euo pipefail", "trap 'kill $(jobs -p) 2>/dev/null || true; wait' EXIT"]
    for i, b in enumerate(todo):
        script += [f"echo '{MARK}{i}'", b.code.replace(DOC_PORT, port)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    r = subprocess.run(["bash", "-c", "\n".join(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=2100)  # fmt: skip
    outputs = r.stdout.split(MARK)[1:]
    ran = len(outputs)
    if r.returncode != 0:
        failed = todo[ran - 1] if ran else todo[0]
        pytest.fail(
            f"{failed.where} failed (exit {r.returncode}):\n{failed.code}\n--- stderr ---\n{r.stderr[-4000:]}"
        )
    assert ran == len(todo)
    for b, out in zip(todo, outputs, strict=True):
        if b.expected is not None:
            missing = out.split("\n", 1)[1] if "\n" in out else ""
            bad = match_output(b.expected, missing)
            assert bad is None, f"{b.where}: the docs show {bad!r}, the command printed:\n{missing}"
