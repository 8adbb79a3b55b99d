"""Fault injection: each fault looks on the wire and on disk like the real failure it imitates."""

from __future__ import annotations

import asyncio
import os
import time

import aiohttp
import pytest
import torch
from _serve_util import TINY_LAYERS, http, load_states, lock_is_held, tiny_dir, wait_lock_shared

from hsgen.protocol import extraction as protocol
from hsgen.serve.faults import FaultPlan
from hsgen.serve.testing import running_server

PROMPT = [60, 61, 62, 63, 64, 65]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with running_server(tiny_dir(), TINY_LAYERS, tmp_path_factory.mktemp("hs")) as url:
        yield url


@pytest.fixture
def faults(server):
    def set_plan(text: str) -> None:
        server.set_faults(text)

    yield set_plan
    server.set_faults(None)


def _complete(url):
    return http(url, "/v1/completions", protocol.completion_request(url.model_name, PROMPT))


def test_http_500_then_recovers(server, faults):
    faults("http_500=1.0:1")
    status, body = _complete(server)
    assert status == 500 and body["error"]["type"] == "InternalServerError" and body["error"]["code"] == 500
    status, body = _complete(server)
    assert status == 200


def test_missing_file(server, faults):
    faults("missing_file=1.0")
    status, body = _complete(server)
    assert status == 200
    path = body["kv_transfer_params"]["hidden_states_path"]
    wait_lock_shared(path)
    time.sleep(0.05)
    assert not os.path.exists(path)
    assert os.path.exists(protocol.lock_path(path))  # vLLM never removes its lock files


def test_truncated_file(server, faults):
    faults("truncated_file=1.0")
    status, body = _complete(server)
    path = body["kv_transfer_params"]["hidden_states_path"]
    wait_lock_shared(path)
    with open(path, "rb") as f, pytest.raises(protocol.ProtocolError, match="truncated"):
        protocol.read_safetensors_header(f, os.path.getsize(path))


def test_nan_values(server, faults):
    faults("nan=1.0")
    status, body = _complete(server)
    path = body["kv_transfer_params"]["hidden_states_path"]
    wait_lock_shared(path)
    states = load_states(path)
    assert torch.isnan(states["hidden_states"]).any()
    assert states["token_ids"].tolist() == PROMPT


def test_token_mismatch(server, faults):
    faults("token_mismatch=1.0")
    status, body = _complete(server)
    path = body["kv_transfer_params"]["hidden_states_path"]
    wait_lock_shared(path)
    ids = load_states(path)["token_ids"].tolist()
    assert ids != body["choices"][0]["prompt_token_ids"] and len(ids) == len(PROMPT)


def test_stale_lock_is_never_released(server, faults):
    faults("stale_lock=1.0:1")
    status, body = _complete(server)
    path = body["kv_transfer_params"]["hidden_states_path"]
    deadline = time.monotonic() + 600
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.2)
    assert lock_is_held(path)
    with pytest.raises(TimeoutError):
        wait_lock_shared(path, timeout=0.3)


async def test_hang_outlives_the_client_timeout(server, faults):
    faults("hang=1.0:1,hang_s=30")
    timeout = aiohttp.ClientTimeout(total=0.5)
    async with aiohttp.ClientSession(timeout=timeout) as s:
        with pytest.raises(asyncio.TimeoutError):
            async with s.post(
                f"{server}/v1/completions", json=protocol.completion_request(server.model_name, PROMPT)
            ):
                pass
    status, _ = _complete(server)
    assert status == 200
    assert server.set_faults(None)["plan"] == ""


def test_fault_plan_parse_and_determinism():
    plan = FaultPlan.parse("http_500=0.5,nan=0.25:3,seed=7,hang_s=2")
    assert plan.rates == {"http_500": 0.5, "nan": 0.25} and plan.limits == {"nan": 3} and plan.hang_s == 2
    draws = [plan.draw() for _ in range(200)]
    again = FaultPlan.parse(plan.to_text())
    assert [again.draw() for _ in range(200)] == draws
    assert draws.count("nan") == 3 and 60 < draws.count("http_500") < 140
    with pytest.raises(ValueError, match="unknown fault kind"):
        FaultPlan.parse("explode=1")
    with pytest.raises(ValueError, match="within 0..1"):
        FaultPlan.parse("nan=2")


async def test_client_disconnect_aborts_and_releases_the_lock(server):
    server.set_capacity("overhead=1.0")
    try:
        before = protocol.parse_prometheus(http(server, "/metrics")[1])
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=0.3)) as s:
            with pytest.raises(asyncio.TimeoutError):
                async with s.post(
                    f"{server}/v1/completions",
                    json=protocol.completion_request(server.model_name, PROMPT),
                    headers={"X-Request-Id": "gone"},
                ):
                    pass
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            after = protocol.parse_prometheus(http(server, "/metrics")[1])
            if after["vllm:request_success_total"] > before["vllm:request_success_total"]:
                break
            await asyncio.sleep(0.05)
        assert after["vllm:request_success_total"] - before["vllm:request_success_total"] == 1  # the abort
        locks = [p for p in server.shared_dir.iterdir() if p.name.startswith("cmpl-gone-")]
        assert [p.suffix for p in locks] == [".lock"]  # left behind, like vLLM, but not held
        assert not lock_is_held(str(locks[0])[: -len(".lock")])
    finally:
        server.set_capacity(None)
