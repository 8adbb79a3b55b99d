"""The file's header is checked against the request before its payload is read (issue 21, hole 3).

A 2 GiB sparse file from a hostile server used to be read whole (4.25 GB of client memory, 46 s)
before any shape check, and on a new store its fake hidden size became the store's header.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from fake_vllm import HUGE_HIDDEN, FakeConfig, FakeVLLM, write_sparse_states_file
from test_client import client_cfg

from hsgen.client import hidden_file
from hsgen.client.fetch import FatalError, FetchError, HiddenStateClient
from hsgen.client.hidden_file import ExpectedStates, WrongStates, read_hidden_states_fd
from hsgen.generate.pipeline import GenerateConfig, generate
from hsgen.generate.sink import LazyStore
from hsgen.inputs.render import RenderedPrompt
from hsgen.store import HiddenStateStore, StoreHeader
from hsgen.store.store import HEADER_FILE

IDS = [5, 6, 7, 8]


@pytest.fixture()
def bytes_read(monkeypatch):
    """Payload bytes the reader asks for (the header is read apart, by the protocol parser)."""
    box = {"n": 0}
    real = hidden_file.read_exact_into

    def counting(fd, view, offset):
        box["n"] += len(view)
        return real(fd, view, offset)

    monkeypatch.setattr(hidden_file, "read_exact_into", counting)
    return box


def _open(path):
    return os.open(path, os.O_RDONLY)


@pytest.mark.parametrize(
    ("expect", "match"),
    [
        (ExpectedStates(3, 8, "float32"), "hidden size 459649, the model's is 8"),
        (ExpectedStates(), "more than any model's"),  # nothing known: a cap still holds
        (ExpectedStates(4, None, None), "sends 3 layers, 4 were asked for"),
        (ExpectedStates(3, HUGE_HIDDEN, "bfloat16"), "sends float32 hidden states, bfloat16 was asked for"),
        (ExpectedStates(3, 8, "float32", store="s"), "hidden size 459649, the store.s is 8 .s."),
    ],
)
def test_a_fake_shape_is_refused_before_the_payload_is_read(tmp_path, bytes_read, expect, match):
    path = tmp_path / "f.safetensors"
    write_sparse_states_file(str(path), IDS, 3, "float32", "huge_hidden")
    assert path.stat().st_size > 16 << 20
    fd = _open(path)
    try:
        with pytest.raises(WrongStates, match=match) as e:
            read_hidden_states_fd(fd, tokens=len(IDS), expect=expect)
    finally:
        os.close(fd)
    assert e.value.fatal and bytes_read["n"] == 0


def test_a_fake_token_count_is_refused_before_the_payload_is_read(tmp_path, bytes_read):
    path = tmp_path / "f.safetensors"
    write_sparse_states_file(str(path), IDS, 3, "float32", "huge_tokens")
    fd = _open(path)
    try:
        with pytest.raises(WrongStates, match="1000000 tokens but 4 were sent") as e:
            read_hidden_states_fd(fd, tokens=len(IDS), expect=ExpectedStates(3, 8, "float32"))
        assert not e.value.fatal and bytes_read["n"] == 0
        # generated tokens allowed: only the prompt's rows are read, never the claimed million
        hidden, tokens, _ = read_hidden_states_fd(fd, tokens=len(IDS), extra_tokens=True)
    finally:
        os.close(fd)
    assert hidden.shape == (4, 3, 8) and tokens.tolist() == IDS
    assert bytes_read["n"] == 4 * 3 * 8 * 4 + 4 * 8


async def test_client_ends_on_a_server_sending_the_wrong_shape(tmp_path):
    shared = tmp_path / "shm"
    shared.mkdir()
    async with FakeVLLM(FakeConfig(str(shared), faults=["huge_hidden"])) as url:
        cfg = client_cfg(url, shared, max_retries=0, expect_layers=3, expect_hidden_size=8)
        async with HiddenStateClient(cfg) as c:
            with pytest.raises(FatalError) as e:
                await c.fetch(RenderedPrompt("s1", IDS, [0, 0, 1, 1]))
    assert e.value.reason == "wrong_states" and "hidden size 459649" in e.value.message
    fake = FakeVLLM(FakeConfig(str(shared), faults=["huge_tokens"]))
    async with fake as url, HiddenStateClient(client_cfg(url, shared, max_retries=0)) as c:
        with pytest.raises(FetchError) as e:
            await c.fetch(RenderedPrompt("s1", IDS, [0, 0, 1, 1]))
    assert e.value.reason == "token_mismatch" and not isinstance(e.value, FatalError)


async def test_a_new_store_never_adopts_a_fake_hidden_size(tmp_path):
    shared = tmp_path / "shm"
    shared.mkdir()
    created = []

    def create(sample):
        created.append(sample.hidden_states.shape)
        h = sample.hidden_states.shape
        return HiddenStateStore.create(tmp_path / "store", StoreHeader("v", (1, 2, 3), h[2], sample.dtype))

    prompts = [RenderedPrompt(f"s{i}", [i + 1, 2, 3], [0, 1, 1]) for i in range(4)]
    async with FakeVLLM(FakeConfig(str(shared), faults=["huge_hidden"] * 8)) as url:
        for expected in (ExpectedStates(3, 8), None):  # the model's hidden size known, or not
            cfg = GenerateConfig(client=client_cfg(url, shared, max_retries=0))
            store = LazyStore(tmp_path / "store", create, expected=expected)
            summary = await generate(cfg, list(prompts), store, progress=False)
            assert summary.exit_code != 0 and "hidden size 459649" in (summary.fatal or ""), summary
    assert created == [] and not (tmp_path / "store" / HEADER_FILE).exists()
    np.testing.assert_equal(len(os.listdir(shared)), 0)
