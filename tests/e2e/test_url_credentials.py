"""Credentials in an endpoint URL are refused in one line and never written nor printed (issue 21,
hole 2): ``--endpoint http://user:KEY@host:port`` used to land KEY in the store's header, every
shard's ``zarr.json``, the generate summary and spectrain's 401 line."""

from __future__ import annotations

import pytest
from test_user_errors import free_port, run

from hsgen import protocol
from hsgen.client import ClientConfig

KEY = "sk-URL-SECRET-21"


def _all_bytes(root) -> bytes:
    return b"".join(p.read_bytes() for p in root.rglob("*") if p.is_file())


def test_redact_url_hides_userinfo_only():
    assert protocol.redact_url(f"http://user:{KEY}@h:8000/v1") == "http://<redacted>@h:8000/v1"
    assert protocol.redact_url(f"https://{KEY}@h") == "https://<redacted>@h"
    assert protocol.redact_url("http://h:8000/a@b") == "http://h:8000/a@b"  # an @ in the path is no userinfo
    assert protocol.redact_url("h:8000") == "h:8000"


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
