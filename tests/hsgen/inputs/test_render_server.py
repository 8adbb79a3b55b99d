"""Rendering through a server's /v1/chat/completions/render agrees with local rendering."""

from __future__ import annotations

import json

import aiohttp
import pytest

from hsgen.inputs.formats import parse_record
from hsgen.inputs.render import ChatRenderer, RenderConfig, RenderError
from hsgen.inputs.render_server import render_messages_with_server
from hsgen.serve.testing import running_server

CONV = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4."},
    {"role": "user", "content": "And 3+3?"},
    {"role": "assistant", "content": "6, obviously."},
]


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_model_dir):
    with running_server(
        tiny_model_dir, [1, 4], tmp_path_factory.mktemp("hs"), served_model_name="tiny", enable_scale_out=True
    ) as url:
        yield url


async def test_server_render_matches_local(server, tiny_model_dir, sample_chats_path):
    local = ChatRenderer(RenderConfig(tokenizer_path=str(tiny_model_dir)))
    convs = [CONV] + [
        list(parse_record(json.loads(line), f"x:{i}").messages)
        for i, line in enumerate(sample_chats_path.read_text().splitlines()[:5])
    ]
    async with aiohttp.ClientSession() as session:
        for i, messages in enumerate(convs):
            ids, mask = await render_messages_with_server(session, server, "tiny", messages)
            want = local.render(parse_record({"messages": messages}, f"c:{i}"))
            assert ids == want.token_ids
            assert mask == want.loss_mask
            assert 0 < sum(mask) < len(mask)


async def test_server_render_error_is_render_error(server):
    async with aiohttp.ClientSession() as session:
        with pytest.raises(RenderError, match="answered 404"):
            await render_messages_with_server(session, server, "no-such-model", CONV)


def test_cli_render_with_server_equals_local_rendering(server, tiny_model_dir, sample_chats_path, tmp_path):
    from click.testing import CliRunner

    from hsgen.cli import main

    lines = sample_chats_path.read_text().splitlines()[:12]
    lines += [
        json.dumps({"id": "plain", "prompt": "def add(a, b):\n    return a + b"}),
        json.dumps({"id": "tok", "input_ids": [5, 6, 7, 8], "loss_mask": [0, 0, 1, 1]}),
    ]
    data = tmp_path / "in.jsonl"
    data.write_text("\n".join(lines) + "\n")
    runner = CliRunner()
    local = runner.invoke(main, ["render", str(data), "--tokenizer", str(tiny_model_dir), "--max-len", "120"])
    remote = runner.invoke(main, ["render", str(data), "--server", f"{server}/v1", "--max-len", "120",
                                  "--concurrency", "4"])  # fmt: skip
    assert local.exit_code == 0, local.output
    assert remote.exit_code == 0, remote.output
    want = [json.loads(x) for x in local.stdout.splitlines() if x.startswith('{"id"')]
    got = [json.loads(x) for x in remote.stdout.splitlines() if x.startswith('{"id"')]
    assert len(got) == len(lines) and got == want  # same order, ids, tokens and masks
    assert any(len(r["input_ids"]) == 120 for r in got)  # --max-len applied the same way


def test_cli_render_with_server_refuses_a_local_tokenizer_too(server, tiny_model_dir, tmp_path):
    from click.testing import CliRunner

    from hsgen.cli import main

    data = tmp_path / "in.jsonl"
    data.write_text(json.dumps({"prompt": "x"}) + "\n")
    res = CliRunner().invoke(
        main, ["render", str(data), "--server", server, "--tokenizer", str(tiny_model_dir)]
    )
    assert res.exit_code == 2 and "--server" in res.output


def test_cli_render_names_the_flag_when_the_render_endpoint_is_off(
    tiny_model_dir, sample_chats_path, tmp_path
):
    """vLLM (and hsgen serve) answer 403 on the render endpoint without --enable-scale-out: one line
    naming the flag, whatever --on-bad-input says (no record could be rendered)."""
    from click.testing import CliRunner

    from hsgen.cli import main

    with running_server(tiny_model_dir, [1, 4], tmp_path / "hs", served_model_name="tiny") as url:
        for policy in ("fail", "skip"):
            res = CliRunner().invoke(main, ["render", str(sample_chats_path), "--server", url,
                                            "--on-bad-input", policy])  # fmt: skip
            assert res.exit_code == 1, res.output
            (line,) = [x for x in res.output.splitlines() if x.startswith("Error")]
            assert "403" in line and "--enable-scale-out" in line and "--tokenizer" in line
