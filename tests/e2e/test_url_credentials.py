"""Credentials in an endpoint URL are refused in one line and never written nor printed (issue 21,
hole 2): ``--endpoint http://user:KEY@host:port`` used to land KEY in the store's header, every
shard's ``zarr.json``, the generate summary and spectrain's 401 line."""

from __future__ import annotations

import json

import pytest
from test_user_errors import free_port, run

from hsgen.client.config import ClientConfig
from hsgen.protocol import extraction as protocol

KEY = "sk-URL-SECRET-21"


def _all_bytes(root) -> bytes:
    return b"".join(p.read_bytes() for p in root.rglob("*") if p.is_file())


def test_redact_url_hides_userinfo_only():
    assert protocol.redact_url(f"http://user:{KEY}@h:8000/v1") == "http://<redacted>@h:8000/v1"
    assert protocol.redact_url(f"https://{KEY}@h") == "https://<redacted>@h"
    assert protocol.redact_url("http://h:8000/a@b") == "http://h:8000/a@b"  # an @ in the path is no userinfo
    assert protocol.redact_url("h:8000") == "h:8000"
    # issue 33: a key holding an @, and an endpoint without a scheme (the client adds http://)
    assert protocol.redact_url(f"http://u:p@{KEY}@h:1/v1") == "http://<redacted>@h:1/v1"
    assert protocol.redact_url(f"u:{KEY}@h:8000") == "<redacted>@h:8000"
    assert protocol.redact_url("h:8000/a@b") == "h:8000/a@b" and protocol.redact_url("h:1?q=@x") == "h:1?q=@x"


def test_client_config_refuses_credentials_in_the_url_without_showing_them():
    with pytest.raises(ValueError) as e:
        ClientConfig(endpoints=["http://h:1", f"http://alice:{KEY}@h:8000"])
    assert KEY not in str(e.value) and "alice" not in str(e.value)
    assert "http://<redacted>@h:8000" in str(e.value) and "--api-key" in str(e.value)


def _refused(r) -> str:
    assert r.returncode != 0 and "Traceback" not in r.stderr, r.stderr
    assert KEY not in r.stderr + r.stdout
    lines = [line for line in r.stderr.splitlines() if "<redacted>@" in line]
    assert len(lines) == 1 and "--api-key" in lines[0], r.stderr
    return lines[0]


def test_generate_refuses_credentials_and_writes_none(tmp_path, sample_chats_path, tiny_model_dir):
    url = f"http://user:{KEY}@127.0.0.1:{free_port()}"
    store = tmp_path / "store"
    r = run("generate", sample_chats_path, "--store", store, "--endpoint", url, "--shared-dir", tmp_path / "hs",
            "--layer-ids", "1,2,4", "--tokenizer", tiny_model_dir, "--no-progress")  # fmt: skip
    _refused(r)
    assert not store.exists() or KEY.encode() not in _all_bytes(store)


def test_render_server_refuses_credentials(tmp_path, sample_chats_path):
    url = f"http://user:{KEY}@127.0.0.1:{free_port()}"
    r = run("render", sample_chats_path, "--server", url, "--model", "m", "--output", tmp_path / "out.jsonl")
    _refused(r)


def test_spectrain_online_refuses_credentials_and_writes_none(tmp_path, sample_chats_path, tiny_model_dir):
    url = f"http://user:{KEY}@127.0.0.1:{free_port()}"
    save = tmp_path / "run"
    r = run("train", "--verifier", tiny_model_dir, "--max-steps", "1", "--online", "--endpoint", url,
            "--prompts", sample_chats_path, "--save-path", save, "--online-option", "layer_ids=[1,2,3,4]",
            module="spectrain.cli", timeout=600)  # fmt: skip
    _refused(r)
    assert not save.exists() or KEY.encode() not in _all_bytes(save)


# Issue 33: every route an endpoint takes to a log line. The INFO line naming a rank's endpoints
# used to print the key before the URL was refused (a template, --world-size > 1, launcher ranks).
ROUTES = {
    "template": (["--endpoint", "http://user:{key}@127.0.0.1:{{{port}+local_rank}}"], {}),
    "world_size": (["--endpoint", "http://user:{key}@127.0.0.1:{port}", "--world-size", "2", "--rank", "1"], {}),
    "launcher_env": (["--endpoint", "http://user:{key}@127.0.0.1:{port}"], {"WORLD_SIZE": "2", "RANK": "1"}),
    "per_local_rank": (["--endpoint", "http://127.0.0.1:1", "--endpoint", "http://user:{key}@127.0.0.1:{port}",
                        "--endpoint-per-local-rank"], {"LOCAL_RANK": "1"}),
    # an endpoint without a scheme gets http:// from the client, after the rank's endpoints were logged
    "bare_template": (["--endpoint", "user:{key}@127.0.0.1:{{{port}+local_rank}}"], {}),
    "bare_world_size": (["--endpoint", "user:{key}@127.0.0.1:{port}", "--world-size", "2", "--rank", "1"], {}),
}  # fmt: skip


@pytest.mark.parametrize("route", sorted(ROUTES))
def test_generate_prints_no_key_whatever_route_the_endpoint_takes(tmp_path, route):
    flags, env = ROUTES[route]
    port = free_port()
    flags = [f.format(key=KEY, port=port) for f in flags]
    data = tmp_path / "d.jsonl"
    data.write_text('{"id": "a", "input_ids": [1, 2, 3]}\n')
    store = tmp_path / "store"
    r = run("generate", data, "--store", store, *flags, "--shared-dir", tmp_path, "--layer-ids", "1,2,4",
            "--no-progress", env=env)  # fmt: skip
    _refused(r)
    assert not store.exists() or KEY.encode() not in _all_bytes(store)


def test_spectrain_online_template_prints_no_key(tmp_path, sample_chats_path, tiny_model_dir):
    url = f"http://user:{KEY}@127.0.0.1:{{{free_port()}+local_rank}}"
    save = tmp_path / "run"
    r = run("train", "--verifier", tiny_model_dir, "--max-steps", "1", "--online", "--endpoint", url,
            "--prompts", sample_chats_path, "--save-path", save, "--online-option", "layer_ids=[1,2,3,4]",
            module="spectrain.cli", timeout=600, env={"WORLD_SIZE": "1", "RANK": "0", "LOCAL_RANK": "0"})  # fmt: skip
    _refused(r)
    assert not save.exists() or KEY.encode() not in _all_bytes(save)


def test_spectrain_online_config_file_prints_no_key(tmp_path, sample_chats_path, tiny_model_dir):
    config = tmp_path / "train.json"
    config.write_text(json.dumps({"online": True, "prompts": str(sample_chats_path), "max_steps": 1,
                                  "endpoints": [f"http://user:{KEY}@127.0.0.1:{{{free_port()}+local_rank}}"],
                                  "save_path": str(tmp_path / "run")}))  # fmt: skip
    r = run("train", "--config", config, "--verifier", tiny_model_dir, "--online-option", "layer_ids=[1,2,3,4]",
            module="spectrain.cli", timeout=600)  # fmt: skip
    _refused(r)


def test_log_lines_carry_no_url_credentials_whatever_logs_them():
    import io
    import logging

    from hsgen.log_format import RedactingFormatter, redact_text

    assert redact_text(f"a http://u:{KEY}@h:1/x and s3://AKIA:{KEY}@b/p, mail a@b") == (
        "a http://<redacted>@h:1/x and s3://<redacted>@b/p, mail a@b"
    )
    # a key holding an @, an endpoint without a scheme (a template's too), an IPv6 host
    line = f"http://u:p@{KEY}@h:1 ['u:{KEY}@h:8000', 'u:{KEY}@10.0.0.1:{{8000+local_rank}}']"
    assert (
        redact_text(line)
        == "http://<redacted>@h:1 ['<redacted>@h:8000', '<redacted>@10.0.0.1:{8000+local_rank}']"
    )
    assert redact_text(f"{KEY}@[::1]:8000 git@github.com:org/repo user@example.com") == (
        "<redacted>@[::1]:8000 git@github.com:org/repo user@example.com"
    )
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(RedactingFormatter("%(levelname)s %(message)s"))
    log = logging.getLogger("hsgen.test_redaction")
    log.addHandler(handler)
    try:
        log.warning("endpoints %s", [f"http://user:{KEY}@h:8000"])
        try:
            raise ValueError(f"cannot reach https://{KEY}@h")
        except ValueError:
            log.exception("failed")  # the traceback's lines too
    finally:
        log.removeHandler(handler)
    err = out.getvalue()
    assert KEY not in err and err.count("<redacted>@h") == 3, err
