"""Chat rendering without transformers: parity with HF apply_chat_template, loss masks, limits."""

from __future__ import annotations

import json
import shutil

import pytest

from hsgen.inputs.formats import parse_record
from hsgen.inputs.render import (
    ChatRenderer,
    RenderConfig,
    RenderedPrompt,
    RenderError,
    TooLong,
    render_stream,
)

CONV = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4."},
    {"role": "user", "content": "And 3+3?"},
    {"role": "assistant", "content": "6, obviously."},
]

# A template in the style of Qwen3: tools via tojson, raise_exception, and earlier assistant
# turns lose their <think> block (so conversation prefixes do not render as prefixes).
THINK_TEMPLATE = """{%- if tools %}<|im_start|>system
Tools: {{ tools | tojson }}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role not in ['system', 'user', 'assistant'] %}{{ raise_exception('bad role ' + message.role) }}{% endif %}
{%- set content = message.content %}
{%- if message.role == 'assistant' and not loop.last and '</think>' in content %}
{%- set content = content.split('</think>')[-1].lstrip('\\n') %}
{%- endif %}
<|im_start|>{{ message.role }}
{{ content }}<|im_end|>
{% endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


@pytest.fixture()
def think_dir(tmp_path, tiny_model_dir):
    d = tmp_path / "tok"
    d.mkdir()
    shutil.copy(tiny_model_dir / "tokenizer.json", d / "tokenizer.json")
    cfg = json.loads((tiny_model_dir / "tokenizer_config.json").read_text())
    cfg["chat_template"] = THINK_TEMPLATE
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    return d


def hf_ids(path, messages, **kw):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path))
    out = tok.apply_chat_template(messages, tokenize=True, **kw)
    return list(out["input_ids"] if hasattr(out, "keys") else out), tok


def masked_text(tok, p: RenderedPrompt) -> str:
    return tok.decode([t for t, m in zip(p.token_ids, p.loss_mask, strict=True) if m])


def test_parity_with_transformers_and_mask(tiny_model_dir, sample_chats_path):
    r = ChatRenderer(RenderConfig(tokenizer_path=str(tiny_model_dir)))
    lines = sample_chats_path.read_text().splitlines()[:40]
    for i, line in enumerate(lines):
        s = parse_record(json.loads(line), f"x:{i}")
        p = r.render(s)
        ref, tok = hf_ids(tiny_model_dir, [dict(m) for m in s.messages])
        assert p.token_ids == ref
        want = "".join(m["content"] + "<|im_end|>" for m in s.messages if m["role"] == "assistant")
        assert masked_text(tok, p) == want


def test_multi_turn_mask(tiny_model_dir):
    r = ChatRenderer(RenderConfig(tokenizer_path=str(tiny_model_dir)))
    p = r.render(parse_record({"messages": CONV}, "x:1"))
    ref, tok = hf_ids(tiny_model_dir, CONV)
    assert p.token_ids == ref
    assert masked_text(tok, p) == "4.<|im_end|>6, obviously.<|im_end|>"
    # user/system tokens are never masked in
    unmasked = tok.decode([t for t, m in zip(p.token_ids, p.loss_mask, strict=True) if not m])
    assert "What is 2+2?" in unmasked and "4." not in unmasked


def test_non_prefix_template_and_tools(think_dir):
    conv = [
        {"role": "user", "content": "q1"},
        {"role": "assistant", "content": "<think>\nhmm\n</think>\n\nfirst answer"},
        {"role": "user", "content": "q2"},
        {"role": "assistant", "content": "<think>\nok\n</think>\n\nsecond answer"},
    ]
    tools = [{"type": "function", "function": {"name": "f", "description": "é"}}]
    r = ChatRenderer(RenderConfig(tokenizer_path=str(think_dir)))
    ids, mask = r.render_messages(conv, tools)
    ref, tok = hf_ids(think_dir, conv, tools=tools)
    assert ids == ref, "jinja settings (trim/lstrip blocks, tojson) must match transformers"
    text = masked_text(tok, RenderedPrompt("x", ids, mask))
    assert "first answer" in text and "second answer" in text and "<think>\nok" in text
    assert "hmm" not in tok.decode(ids), "the template dropped the earlier think block"
    assert "q1" not in text and "q2" not in text


def test_template_errors_are_render_errors(think_dir):
    r = ChatRenderer(RenderConfig(tokenizer_path=str(think_dir)))
    s = parse_record({"messages": [{"role": "tool", "content": "x"}]}, "data.jsonl:5")
    with pytest.raises(RenderError, match=r"data.jsonl:5: chat template failed: bad role tool"):
        r.render(s)


def test_max_len_truncate_and_skip(tiny_model_dir):
    s = parse_record({"id": "a", "messages": CONV}, "x:1")
    full = ChatRenderer(RenderConfig(tokenizer_path=str(tiny_model_dir))).render(s)
    t = ChatRenderer(RenderConfig(tokenizer_path=str(tiny_model_dir), max_len=10)).render(s)
    assert t.truncated and t.token_ids == full.token_ids[:10] and t.loss_mask == full.loss_mask[:10]
    with pytest.raises(TooLong):
        ChatRenderer(RenderConfig(tokenizer_path=str(tiny_model_dir), max_len=10, on_too_long="skip")).render(
            s
        )
    ok = ChatRenderer(RenderConfig(tokenizer_path=str(tiny_model_dir), max_len=len(full.token_ids))).render(s)
    assert not ok.truncated


def test_tokens_and_prompt_kinds(tiny_model_dir):
    r0 = ChatRenderer(RenderConfig())
    p = r0.render(parse_record({"id": "t", "input_ids": [3, 4, 5]}, "x:1"))
    assert p.loss_mask == [1, 1, 1]
    p = r0.render(parse_record({"id": "t", "input_ids": [3, 4], "loss_mask": [0, 1]}, "x:1"))
    assert p.loss_mask == [0, 1]
    with pytest.raises(RenderError, match="--tokenizer"):
        r0.render(parse_record({"prompt": "hello"}, "x:2"))
    r = ChatRenderer(RenderConfig(tokenizer_path=str(tiny_model_dir)))
    p = r.render(parse_record({"prompt": "hello world"}, "x:3"))
    from tokenizers import Tokenizer

    assert (
        p.token_ids == Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json")).encode("hello world").ids
    )
    assert set(p.loss_mask) == {1}


def test_fingerprint(tiny_model_dir, think_dir):
    a = ChatRenderer(RenderConfig(tokenizer_path=str(tiny_model_dir))).fingerprint
    b = ChatRenderer(RenderConfig(tokenizer_path=str(think_dir))).fingerprint
    a2 = ChatRenderer(RenderConfig(tokenizer_path=str(tiny_model_dir))).fingerprint
    assert len(a) == 64 and a == a2 and a != b
    assert ChatRenderer(RenderConfig()).fingerprint == ""


def test_render_stream_skips(tmp_path, tiny_model_dir):
    from hsgen.inputs.render import Skipped

    p = tmp_path / "d.jsonl"
    p.write_text(
        json.dumps({"id": "a", "messages": CONV})
        + "\n{broken\n"
        + json.dumps({"id": "b", "input_ids": list(range(1, 40))})
        + "\n"
    )
    r = ChatRenderer(RenderConfig(tokenizer_path=str(tiny_model_dir), max_len=30, on_too_long="skip"))
    items = list(render_stream([str(p)], r, on_bad_input="skip"))
    kinds = [(type(x).__name__, getattr(x, "reason", None)) for x in items]
    assert kinds == [("Skipped", "too_long"), ("Skipped", "bad_input"), ("Skipped", "too_long")]
    assert isinstance(items[1], Skipped) and f"{p}:2" in items[1].message
    r = ChatRenderer(RenderConfig(tokenizer_path=str(tiny_model_dir)))
    with pytest.raises(Exception, match=f"{p}:2"):
        list(render_stream([str(p)], r, on_bad_input="fail"))


def test_cli_render_output(tmp_path, tiny_model_dir):
    from click.testing import CliRunner

    from hsgen.cli.generate import render

    p = tmp_path / "d.jsonl"
    p.write_text(
        json.dumps({"id": "a", "messages": CONV}) + "\n" + json.dumps({"id": "b", "prompt": "hi"}) + "\n"
    )
    out = tmp_path / "out.jsonl"
    res = CliRunner().invoke(render, [str(p), "--tokenizer", str(tiny_model_dir), "-o", str(out)])
    assert res.exit_code == 0, res.output
    recs = [json.loads(x) for x in out.read_text().splitlines()]
    assert [r["id"] for r in recs] == ["a", "b"]
    assert all(len(r["input_ids"]) == len(r["loss_mask"]) for r in recs)
    summary = json.loads(res.stderr.strip().splitlines()[-1])
    assert summary["rendered"] == 2 and len(summary["tokenizer_fingerprint"]) == 64
