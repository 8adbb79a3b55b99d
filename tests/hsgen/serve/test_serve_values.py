"""The server's hidden states equal a plain transformers forward of the same model."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
import torch
from _serve_util import (
    TINY_LAYERS,
    http,
    load_states,
    plain_model,
    reference_states,
    tiny_dir,
    wait_lock_shared,
)

from hsgen.protocol import extraction as protocol
from hsgen.serve.testing import running_server

PROMPTS = [
    [101, 102, 103, 104, 105, 106, 107, 108, 109, 110, 111],
    [7, 8, 9],
    [300, 301, 302, 303, 304, 305, 306],
    [5, 500, 50, 900, 9, 90, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51],
    [12],
    [640, 641, 642, 643, 644],
]


async def _fetch_all(url: str, prompts: list[list[int]]) -> list[dict]:
    async with aiohttp.ClientSession() as session:

        async def one(p):
            async with session.post(
                f"{url}/v1/completions", json=protocol.completion_request(url.model_name, p)
            ) as r:
                assert r.status == 200, await r.text()
                return await r.json()

        return await asyncio.gather(*(one(p) for p in prompts))


def _file_for(resp: dict) -> dict:
    result = protocol.parse_extraction_response(resp)
    wait_lock_shared(result.hidden_states_path)
    return load_states(result.hidden_states_path)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_single_request_equals_transformers_exactly(tmp_path, dtype):
    torch.set_num_threads(1)
    with running_server(tiny_dir(), TINY_LAYERS, tmp_path, dtype=dtype, torch_threads=1) as url:
        for prompt in PROMPTS[:3]:
            status, resp = http(url, "/v1/completions", protocol.completion_request(url.model_name, prompt))
            assert status == 200
            states = _file_for(resp)
            expected, _, next_token = reference_states(prompt, TINY_LAYERS, dtype)
            assert states["hidden_states"].dtype == getattr(torch, dtype)
            assert torch.equal(states["hidden_states"], expected)
            assert resp["choices"][0]["token_ids"] == [next_token]


def test_layer_L_is_before_the_final_norm(tmp_path):
    prompt = PROMPTS[0]
    with running_server(tiny_dir(), [2, 4], tmp_path, dtype="float32", torch_threads=1) as url:
        status, resp = http(url, "/v1/completions", protocol.completion_request(url.model_name, prompt))
        states = _file_for(resp)["hidden_states"]
    _, hf_hidden, next_token = reference_states(prompt, [4], "float32")
    model = plain_model("float32")
    last = states[:, 1]
    assert not torch.allclose(last, hf_hidden[4][0])  # HF's last entry is after the norm
    with torch.inference_mode():
        torch.testing.assert_close(model.model.norm(last), hf_hidden[4][0], rtol=1e-5, atol=1e-5)
        assert int(model.lm_head(model.model.norm(last[-1])).argmax()) == next_token
    torch.testing.assert_close(states[:, 0], hf_hidden[2][0], rtol=0, atol=0)


@pytest.mark.parametrize("dtype,tol", [("float32", 1e-5), ("bfloat16", 3e-2)])
async def test_batched_requests_equal_unbatched_forward(tmp_path, dtype, tol):
    """Concurrent prompts of different lengths share padded forwards; values stay those of each prompt alone."""
    with running_server(
        tiny_dir(), TINY_LAYERS, tmp_path, dtype=dtype, torch_threads=1, capacity="overhead=0.3,max_seqs=8"
    ) as url:
        before = protocol.parse_prometheus(http(url, "/metrics")[1])
        resps = await _fetch_all(url, PROMPTS)
        after = protocol.parse_prometheus(http(url, "/metrics")[1])
    steps = after["hsgen:engine_steps_total"] - before["hsgen:engine_steps_total"]
    assert steps < len(PROMPTS), "concurrent requests were not batched"
    busy = after["hsgen:engine_busy_seconds_total"] - before["hsgen:engine_busy_seconds_total"]
    assert busy >= 0.29 * steps, "each step lasts at least the capacity model's 0.3 s overhead"
    for prompt, resp in zip(PROMPTS, resps, strict=True):
        states = _file_for(resp)
        expected, _, next_token = reference_states(prompt, TINY_LAYERS, dtype)
        assert states["token_ids"].tolist() == prompt
        torch.testing.assert_close(states["hidden_states"].float(), expected.float(), rtol=tol, atol=tol)
        if dtype == "float32":
            assert resp["choices"][0]["token_ids"] == [next_token]
