"""The file + ``.lock`` protocol per vLLM version row, under concurrent requests."""

from __future__ import annotations

import asyncio
import os
import time
from concurrent.futures import ThreadPoolExecutor

import aiohttp
import pytest
from _serve_util import TINY_LAYERS, http, load_states, lock_is_held, tiny_dir, wait_lock_shared

from hsgen.protocol import extraction as protocol
from hsgen.serve.testing import running_server

# ~8 KB per file at 20 KB/s: each write holds its lock for ~0.4 s.
SLOW_DISK = "write_bytes_per_s=20000"
PROMPTS = [[40 + i for i in range(8 * (j + 1))] for j in range(4)]


async def _post_and_inspect(url: str, prompt: list[int]) -> tuple[dict, bool, bool, bool]:
    """POST, then at once: (response, lock file exists, lock held, data file exists)."""
    async with (
        aiohttp.ClientSession() as session,
        session.post(f"{url}/v1/completions", json=protocol.completion_request(url.model_name, prompt)) as r,
    ):
        assert r.status == 200, await r.text()
        body = await r.json()
    path = body["kv_transfer_params"]["hidden_states_path"]
    return body, os.path.exists(protocol.lock_path(path)), lock_is_held(path), os.path.exists(path)


@pytest.mark.parametrize("version", ["0.24", "0.22"])
async def test_reader_lock_blocks_until_write_ends(tmp_path, version):
    with running_server(tiny_dir(), TINY_LAYERS, tmp_path, vllm_version=version, capacity=SLOW_DISK) as url:
        results = await asyncio.gather(*(_post_and_inspect(url, p) for p in PROMPTS))
        for body, lock_exists, held, data_exists in results:
            assert lock_exists and held, "the lock must be held before the response is sent"
            if version == "0.24":
                assert (
                    not data_exists or os.path.getsize(body["kv_transfer_params"]["hidden_states_path"]) == 0
                )

        def read(body):
            path = body["kv_transfer_params"]["hidden_states_path"]
            blocked = wait_lock_shared(path)
            states = load_states(path)  # complete as soon as the shared lock is granted
            return blocked, states["token_ids"].tolist(), body["choices"][0]["prompt_token_ids"]

        with ThreadPoolExecutor(len(results)) as pool:
            reads = list(pool.map(read, [r[0] for r in results]))
    assert max(blocked for blocked, _, _ in reads) > 0.1
    for _, ids, prompt in reads:
        assert ids == prompt


async def test_old_versions_write_before_the_response_without_lock(tmp_path):
    with running_server(tiny_dir(), TINY_LAYERS, tmp_path, vllm_version="0.18", capacity=SLOW_DISK) as url:
        t0 = time.monotonic()
        results = await asyncio.gather(*(_post_and_inspect(url, p) for p in PROMPTS[:2]))
        assert time.monotonic() - t0 > 0.3  # the response waited for the write
        for body, lock_exists, _, data_exists in results:
            assert data_exists and not lock_exists
            path = body["kv_transfer_params"]["hidden_states_path"]
            assert load_states(path)["token_ids"].tolist() == body["choices"][0]["prompt_token_ids"]


async def test_include_output_tokens_is_ignored_before_0_24(tmp_path):
    with running_server(tiny_dir(), TINY_LAYERS, tmp_path, vllm_version="0.22") as url:
        body = protocol.completion_request(url.model_name, [9, 8, 7], include_output_tokens=True)
        body["max_tokens"] = 2
        body["ignore_eos"] = True
        status, resp = http(url, "/v1/completions", body)
        assert status == 200
        path = resp["kv_transfer_params"]["hidden_states_path"]
        wait_lock_shared(path)
        assert load_states(path)["token_ids"].tolist() == [9, 8, 7]


async def test_max_num_seqs_queues_the_rest(tmp_path):
    with running_server(
        tiny_dir(), TINY_LAYERS, tmp_path, max_num_seqs=2, capacity="overhead=0.25,max_seqs=64"
    ) as url:
        seen = {"running": 0.0, "waiting": 0.0}

        async def watch():
            async with aiohttp.ClientSession() as s:
                for _ in range(40):
                    async with s.get(f"{url}/metrics") as r:
                        m = protocol.parse_prometheus(await r.text())
                    seen["running"] = max(seen["running"], m["vllm:num_requests_running"])
                    seen["waiting"] = max(seen["waiting"], m["vllm:num_requests_waiting"])
                    await asyncio.sleep(0.02)

        async def send():
            async with aiohttp.ClientSession() as s:

                async def one(p):
                    async with s.post(
                        f"{url}/v1/completions", json=protocol.completion_request(url.model_name, p)
                    ) as r:
                        assert r.status == 200

                await asyncio.gather(*(one([3, 4, 5 + i]) for i in range(6)))

        await asyncio.gather(watch(), send())
    assert seen["running"] == 2
    assert seen["waiting"] >= 2
