"""Shared fixtures: the built-in tiny verifier and the shipped sample conversations."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    """Directory of the built-in tiny Qwen3-style verifier (built once, then cached)."""
    from hsgen.tiny import ensure_tiny_model

    return ensure_tiny_model()


@pytest.fixture(scope="session")
def sample_chats_path() -> Path:
    """The shipped sample chat dataset (JSONL of OpenAI ``messages``)."""
    from hsgen.sample_data import sample_chats_path

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
