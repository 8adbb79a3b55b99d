"""Failures a user must hear about, in one line each (issue 21, hole 8).

Before: over-long prompts (HTTP 400 from the server) ended ``hsgen generate`` with exit 3 and
nothing on stderr; a pretty-printed JSON array given as JSONL with ``--on-bad-input skip`` gave a
warning per line, stored nothing and exited 0; online training said nothing about chats without
an assistant turn (``hsgen generate`` counts them).
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys

import pytest
from click.testing import CliRunner

from hsgen.cli.generate import generate as gen_cmd
from hsgen.serve.testing import running_server

MAX = 32


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    shared = tmp_path_factory.mktemp("shm")
    with running_server("tiny", [1, 2, 4], shared, max_model_len=MAX) as url:
        yield url, shared


def _args(data, tmp_path, server, *extra):
    url, shared = server
    return [str(data), "--store", str(tmp_path / "st"), "--endpoint", url, "--shared-dir", str(shared),
            "--layer-ids", "1,2,4", "--no-progress", *extra]  # fmt: skip


def test_over_long_prompts_give_one_line_with_the_count_and_the_first_reason(tmp_path, server):
    data = tmp_path / "p.jsonl"
    rows = [{"id": f"ok{i}", "input_ids": [5 + i, 6, 7, 8]} for i in range(3)]
    rows += [{"id": f"long{i}", "input_ids": [9] * (MAX + 8 + i)} for i in range(2)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    r = CliRunner().invoke(gen_cmd, _args(data, tmp_path, server))
    assert r.exit_code == 3, (r.output, r.stderr)
    summary = json.loads(r.stdout.strip().splitlines()[-1])
    assert summary["stored"] == 3 and summary["failed"] == 2
    lines = [line for line in r.stderr.splitlines() if line.startswith("hsgen generate:")]
    assert len(lines) == 1, r.stderr
    line = lines[0]
    first = (
        f"{data}:4: long0" in line or f"{data}:5: long1" in line
    )  # requests run at once: either fails first
    assert "2 prompts failed (2 http_400)" in line and first, line
    assert str(MAX) in line and summary["failures_file"] in line, line


def test_a_pretty_printed_json_array_is_refused_whole_in_one_line(tmp_path, server):
    data = tmp_path / "p.jsonl"
    data.write_text(json.dumps([{"id": f"a{i}", "input_ids": [i + 1, 2, 3]} for i in range(20)], indent=2))
    r = subprocess.run([sys.executable, "-m", "hsgen.cli", "generate", *_args(data, tmp_path, server, "--on-bad-input",
                        "skip")], capture_output=True, text=True, timeout=300)  # fmt: skip
    assert r.returncode == 1, r.stderr
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and str(data) in lines[0] and "pretty-printed JSON array" in lines[0], r.stderr
    assert "skipping bad input" not in r.stderr and json.loads(r.stdout.splitlines()[-1])["stored"] == 0


def test_online_prompts_warn_once_for_chats_without_an_assistant_turn(tmp_path, caplog):
    from hsgen.hf.tiny import ensure_tiny_model
    from spectrain.online.config import OnlineConfig
    from spectrain.online.prompts import PromptSet

    data = tmp_path / "chats.jsonl"
    rows = [{"id": f"c{i}", "messages": [{"role": "user", "content": f"hi {i}"},
                                         {"role": "assistant", "content": "hello"}]} for i in range(4)]  # fmt: skip
    rows += [
        {"id": f"q{i}", "messages": [{"role": "user", "content": f"only a question {i}"}]} for i in range(3)
    ]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = OnlineConfig(endpoints=["http://127.0.0.1:9"], prompts=[str(data)], store=str(tmp_path / "st"),
                       verifier=str(ensure_tiny_model()), save_path=str(tmp_path / "run"), validation_fraction=0.0)  # fmt: skip
    with caplog.at_level(logging.WARNING):
        PromptSet(cfg)
    warned = [r.getMessage() for r in caplog.records if "no assistant turn" in r.getMessage()]
    assert len(warned) == 1, warned
    assert "3 chats have no assistant turn" in warned[0] and f"{data}:5" in warned[0], warned
