"""Bad input keeps its promise: named file and line, --on-bad-input honoured, nothing dropped silently.

Issue 13, points 7 (empty input, no assistant turn) and 8 (non-UTF-8 bytes, duplicate ids).
"""

from __future__ import annotations

import gzip
import json

import pytest
from click.testing import CliRunner
from fake_vllm import FakeConfig, FakeVLLM

from hsgen.client.config import ClientConfig
from hsgen.generate.pipeline import EXIT_FAILURE, GenerateConfig, generate
from hsgen.inputs.formats import InputError, InputStats, read_inputs
from hsgen.inputs.render import RenderedPrompt
from hsgen.store import HiddenStateStore, StoreHeader

BAD_LINE = b'{"id": "b", "prompt": "caf\xe9"}\n'  # latin-1, not UTF-8


def _write(path, lines: list[bytes]):
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "wb") as f:
        f.write(b"".join(lines))
    return path


@pytest.mark.parametrize("name", ["d.jsonl", "d.jsonl.gz"])
def test_non_utf8_line_names_file_and_line_and_can_be_skipped(tmp_path, name):
    good = [json.dumps({"id": f"g{i}", "input_ids": [1, 2, i + 3]}).encode() + b"\n" for i in range(2)]
    path = _write(tmp_path / name, [good[0], BAD_LINE, good[1]])
    with pytest.raises(InputError) as ei:
        list(read_inputs([path], on_bad_input="fail"))
    assert str(ei.value).startswith(f"{path}:2: not UTF-8") and "0xe9" in str(ei.value)
    stats = InputStats()
    got = list(read_inputs([path], on_bad_input="skip", stats=stats))
    assert [s.sample_id for s in got] == ["g0", "g1"]
    assert stats.bad == 1 and f"{path}:2" in stats.bad_examples[0]


def test_generate_skips_a_non_utf8_line_and_lists_it(tmp_path):
    from hsgen.cli.generate import generate as gen_cmd

    shared = tmp_path / "shm"
    good = [json.dumps({"id": f"g{i}", "input_ids": [1, 2, i + 3]}).encode() + b"\n" for i in range(3)]
    data = _write(tmp_path / "d.jsonl", [good[0], BAD_LINE, good[1], good[2]])
    with FakeVLLM(FakeConfig(str(shared))).in_thread() as url:
        base = [str(data), "--store", str(tmp_path / "st"), "--endpoint", url, "--shared-dir", str(shared)]
        base += ["--layer-ids", "1,2,4", "--no-progress", "--log-level", "ERROR"]
        r = CliRunner().invoke(gen_cmd, [*base, "--on-bad-input", "skip"])
    summary = json.loads(r.stdout.strip().splitlines()[-1])
    assert r.exit_code == 0 and summary["stored"] == 3 and summary["bad_input"] == 1
    fails = [json.loads(x) for x in (tmp_path / "st.failures.jsonl").read_text().splitlines()]
    assert fails[0]["reason"] == "bad_input" and fails[0]["source"] == f"{data}:2"


def _prompt(sid, ids, source):
    return RenderedPrompt(sid, ids, [1] * len(ids), source=source)


async def test_duplicate_id_with_other_content_is_reported_not_dropped(tmp_path):
    shared = tmp_path / "shm"
    items = [
        _prompt("a", [1, 2, 3], "d.jsonl:1"),
        _prompt("b", [4, 5, 6], "d.jsonl:2"),
        _prompt("a", [1, 2, 3], "d.jsonl:3"),  # the same record twice: a plain duplicate
        _prompt("a", [7, 8, 9], "d.jsonl:4"),  # the same id, other content: reported
    ]
    fails = tmp_path / "fails.jsonl"
    async with FakeVLLM(FakeConfig(str(shared))) as url:
        client = ClientConfig(endpoints=[url], shared_dir=str(shared))
        store = HiddenStateStore.create(tmp_path / "st", StoreHeader("fake-model", (1, 2, 4), 8, "float32"))
        cfg = GenerateConfig(client=client, failures_path=str(fails), shard_bytes=1024)
        s = await generate(cfg, items, store, progress=False)
        assert (s.stored, s.duplicates, s.duplicate_conflicts, s.exit_code) == (2, 1, 1, 0)
        assert store.read("a").token_ids.tolist() == [1, 2, 3], "the first record is kept"
        line = json.loads(fails.read_text())
        assert line["reason"] == "duplicate_id" and line["sample_id"] == "a" and line["source"] == "d.jsonl:4"
        store2 = HiddenStateStore.create(tmp_path / "st2", StoreHeader("fake-model", (1, 2, 4), 8, "float32"))
        cfg = GenerateConfig(client=client, shard_bytes=1024, on_bad_input="fail")
        s = await generate(cfg, items, store2, progress=False)
    assert s.exit_code == EXIT_FAILURE and "d.jsonl:4" in s.fatal and "'a'" in s.fatal


def test_empty_input_and_chat_without_assistant_turn_warn(tmp_path, tiny_model_dir, caplog):
    from hsgen.cli.generate import generate as gen_cmd
    from hsgen.cli.generate import render as render_cmd

    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    shared = tmp_path / "shm"
    with FakeVLLM(FakeConfig(str(shared))).in_thread() as url:
        r = CliRunner().invoke(
            gen_cmd,
            [str(empty), "--store", str(tmp_path / "st"), "--endpoint", url, "--shared-dir", str(shared)]
            + ["--layer-ids", "1,2,4", "--no-progress"],
        )
    assert r.exit_code == 0, r.output
    assert "the input holds no prompts" in caplog.text
    chat = tmp_path / "chat.jsonl"
    chat.write_text(json.dumps({"id": "q", "messages": [{"role": "user", "content": "hello there"}]}) + "\n")
    r = CliRunner().invoke(render_cmd, [str(chat), "--tokenizer", str(tiny_model_dir)])
    assert r.exit_code == 0, r.output
    assert "'q' has no assistant turn" in caplog.text
    assert json.loads(r.stderr.strip().splitlines()[-1])["no_assistant_turn"] == 1
