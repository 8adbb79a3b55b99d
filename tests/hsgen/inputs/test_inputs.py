"""Dataset readers: formats, stable ids, errors naming file and line, skip/fail."""

from __future__ import annotations

import io
import json

import pytest

from hsgen.inputs.formats import InputError, InputStats, content_id, parse_record, read_inputs, sample_to_json

MSGS = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_all_formats_jsonl(tmp_path):
    recs = [
        {"id": "a", "messages": MSGS},
        {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]},
        {"id": 7, "input_ids": [1, 2, 3], "loss_mask": [0, 1, 1]},
        {"prompt": "plain text"},
        {"text": "other text"},
    ]
    out = list(read_inputs([write_jsonl(tmp_path / "d.jsonl", recs)]))
    assert [s.kind for s in out] == ["messages", "messages", "tokens", "prompt", "prompt"]
    assert out[0].sample_id == "a" and out[2].sample_id == "7"
    assert list(out[1].messages) == MSGS, "ShareGPT turns map to OpenAI roles"
    assert out[2].input_ids == (1, 2, 3) and out[2].loss_mask == (0, 1, 1)
    assert out[0].source.endswith("d.jsonl:1") and out[3].source.endswith("d.jsonl:4")


def test_content_ids_are_stable_and_format_independent(tmp_path):
    a = parse_record({"messages": MSGS}, "x:1")
    b = parse_record(
        {"conversations": [{"from": "user", "value": "hi"}, {"from": "assistant", "value": "hello"}]}, "y:9"
    )
    c = parse_record({"messages": MSGS[:1]}, "x:2")
    assert a.sample_id == b.sample_id == content_id({"messages": MSGS})
    assert a.sample_id != c.sample_id
    assert a.sample_id.startswith("h") and len(a.sample_id) == 33


def test_json_and_parquet_and_stdin(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "d.json").write_text(
        json.dumps([{"id": "j1", "prompt": "x"}, {"id": "j2", "input_ids": [4]}])
    )
    (tmp_path / "w.json").write_text(json.dumps({"data": [{"id": "w1", "prompt": "y"}]}))
    table = pa.table(
        {
            "id": ["p1", "p2"],
            "messages": [MSGS, MSGS[:1] + [{"role": "assistant", "content": "yo"}]],
        }
    )
    pq.write_table(table, tmp_path / "d.parquet")
    stdin = io.StringIO('{"id": "s1", "input_ids": [9, 9]}\n\n{"id": "s2", "prompt": "z"}\n')
    paths = [tmp_path / "d.json", tmp_path / "w.json", tmp_path / "d.parquet", "-"]
    out = list(read_inputs(paths, stdin=stdin))
    assert [s.sample_id for s in out] == ["j1", "j2", "w1", "p1", "p2", "s1", "s2"]
    assert out[3].messages[1]["content"] == "hello"
    assert out[4].source.endswith("d.parquet:row 1")
    assert out[6].source == "<stdin>:3"


@pytest.mark.parametrize(
    "line,needle",
    [
        ("{not json", "invalid JSON"),
        ('{"foo": 1}', "no prompt found"),
        ('{"input_ids": [1, 2], "loss_mask": [1]}', "'loss_mask' has 1 entries"),
        ('{"input_ids": [1, "x"]}', "input_ids[1]"),
        ('{"input_ids": []}', "is empty"),
        ('{"messages": [{"role": "robot", "content": "x"}]}', "messages[0].role"),
        ('{"conversations": [{"from": "alien", "value": "x"}]}', "conversations[0].from"),
        ('{"id": ["a"], "prompt": "x"}', "field 'id'"),
        ("[1, 2]", "expected a JSON object"),
    ],
)
def test_bad_lines_name_file_and_line(tmp_path, line, needle):
    p = tmp_path / "bad.jsonl"
    p.write_text('{"prompt": "ok"}\n' + line + "\n")
    with pytest.raises(InputError) as ei:
        list(read_inputs([p]))
    assert f"{p}:2" in str(ei.value) and needle in str(ei.value)


def test_skip_counts_bad_records(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_text('{"prompt": "a"}\n{bad\n{"prompt": "b"}\n{"x": 1}\n')
    stats = InputStats()
    out = list(read_inputs([p], on_bad_input="skip", stats=stats))
    assert [s.prompt for s in out] == ["a", "b"]
    assert stats.read == 2 and stats.bad == 2
    assert f"{p}:2" in stats.bad_examples[0] and f"{p}:4" in stats.bad_examples[1]


def test_missing_file_and_unknown_suffix(tmp_path):
    with pytest.raises(InputError, match="no such file"):
        list(read_inputs([tmp_path / "nope.jsonl"]))
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(InputError, match="unknown dataset format"):
        list(read_inputs([tmp_path / "x.csv"]))


def test_sample_to_json_roundtrip():
    for rec in [
        {"id": "a", "messages": MSGS},
        {"id": "b", "input_ids": [1, 2], "loss_mask": [0, 1]},
        {"id": "c", "prompt": "t"},
    ]:
        s = parse_record(rec, "x:1")
        assert parse_record(sample_to_json(s), "y:1") == parse_record(rec, "y:1")
