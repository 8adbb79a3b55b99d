"""Shared fixtures: the built-in tiny verifier and the shipped sample conversations."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    """Directory of the built-in tiny Qwen3-style verifier (built once, then cached)."""
    from hsgen.hf.tiny import ensure_tiny_model

    return ensure_tiny_model()


@pytest.fixture(scope="session")
def sample_chats_path() -> Path:
    """The shipped sample chat dataset (JSONL of OpenAI ``messages``)."""
    from hsgen.inputs.sample_data import sample_chats_path

    return sample_chats_path()


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """An empty Hugging Face cache under ``$HF_HOME``, with ``HF_HUB_OFFLINE=1`` (tests never download)."""
    home = tmp_path / "hf-home"
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return home / "hub"


@pytest.fixture(scope="session")
def family_model(tmp_path_factory, tiny_model_dir):
    """``family_model(name)``: the directory of a tiny random model of a verifier family
    (``tests/_families.py``), saved once per session with the tiny tokenizer."""
    from _families import family_dirs

    return family_dirs(tmp_path_factory.mktemp("families"), tiny_model_dir)


@pytest.fixture(scope="session")
def s3_server():
    """A real S3-compatible server (moto's server mode) on an ephemeral port, for the session."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


@pytest.fixture
def s3_url(s3_server, monkeypatch):
    """``s3://<fresh bucket>/store`` on the test server, with the standard AWS variables set."""
    import secrets

    import boto3

    for name, value in {
        "AWS_ENDPOINT_URL": s3_server,
        "AWS_ACCESS_KEY_ID": "hsgen-test",
        "AWS_SECRET_ACCESS_KEY": "hsgen-test-secret",
        "AWS_DEFAULT_REGION": "us-east-1",
    }.items():
        monkeypatch.setenv(name, value)
    bucket = f"hsgen-{secrets.token_hex(6)}"
    boto3.client("s3", endpoint_url=s3_server).create_bucket(Bucket=bucket)
    return f"s3://{bucket}/store"


def pytest_collection_modifyitems(config, items):
    """Tests marked ``vllm`` (the real-vLLM tier, tests/vllm/) run only when ``-m`` names them
    (``python -m pytest -m vllm``): the README's test command stays fast."""
    if "vllm" in (config.getoption("markexpr", "") or ""):
        return
    keep = [item for item in items if item.get_closest_marker("vllm") is None]
    if len(keep) != len(items):
        config.hook.pytest_deselected(items=[item for item in items if item.get_closest_marker("vllm")])
        items[:] = keep
