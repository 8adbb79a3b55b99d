"""HiddenStateClient against a scripted fake vLLM: hand-off modes, validation, retries, breaker."""

from __future__ import annotations

import asyncio
import os
import time

import numpy as np
import pytest
from fake_vllm import FakeConfig, FakeVLLM, expected_states

from hsgen.client.fetch import (
    CircuitBreaker,
    ClientConfig,
    FatalError,
    FetchError,
    HiddenStateClient,
    all_finite,
    normalize_endpoint,
)
from hsgen.inputs.render import RenderedPrompt

PROMPT = RenderedPrompt("s1", [5, 6, 7, 8], [0, 0, 1, 1])


def client_cfg(urls, shared, **kw) -> ClientConfig:
    base = dict(
        shared_dir=str(shared),
        file_wait_s=2.0,
        lock_timeout_s=1.0,
        settle_s=0.2,
        backoff_s=0.01,
        backoff_max_s=0.05,
        request_timeout_s=5.0,
    )
    base.update(kw)
    return ClientConfig(endpoints=urls if isinstance(urls, list) else [urls], **base)


def leftovers(d) -> list[str]:
    return sorted(os.listdir(d))


@pytest.mark.parametrize("mode", ["sync", "lock", "late"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
async def test_fetch_each_handoff_mode(tmp_path, mode, dtype):
    shared = tmp_path / "shm"
    async with (
        FakeVLLM(FakeConfig(str(shared), mode=mode, dtype=dtype, write_delay_s=0.05)) as url,
        HiddenStateClient(client_cfg(url, shared)) as c,
    ):
        s = await c.fetch(PROMPT)
    assert s.sample_id == "s1" and s.dtype == dtype
    assert s.hidden_states.shape == (4, 3, 8)
    want = expected_states(PROMPT.token_ids, 3, 8, dtype)
    np.testing.assert_array_equal(s.hidden_states, want.view(s.hidden_states.dtype))
    assert s.token_ids.tolist() == PROMPT.token_ids and s.token_ids.dtype == np.int64
    assert s.loss_mask.tolist() == [0, 0, 1, 1] and s.loss_mask.dtype == np.uint8
    assert leftovers(shared) == [], "file and lock must be deleted after reading"


async def test_lock_is_waited_for(tmp_path):
    shared = tmp_path / "shm"
    async with (
        FakeVLLM(FakeConfig(str(shared), mode="lock", write_delay_s=0.3)) as url,
        HiddenStateClient(client_cfg(url, shared)) as c,
    ):
        t0 = time.monotonic()
        s = await c.fetch(PROMPT)
        assert time.monotonic() - t0 >= 0.3
    assert s.hidden_states.shape[0] == 4


@pytest.mark.parametrize(
    "fault,reason",
    [
        ("nan", "non_finite"),
        ("token_mismatch", "token_mismatch"),
        ("http_400", "http_400"),
        ("outside", None),
    ],
)
async def test_permanent_faults_are_not_retried(tmp_path, fault, reason):
    shared = tmp_path / "shm"
    fake = FakeVLLM(FakeConfig(str(shared), faults=[fault]))
    async with fake as url, HiddenStateClient(client_cfg(url, shared, max_retries=3)) as c:
        with pytest.raises(FetchError) as ei:
            await c.fetch(PROMPT)
    assert not ei.value.transient
    assert fake.requests == 1
    if reason:
        assert ei.value.reason == reason
    else:
        assert ei.value.reason == "path_outside_shared_dir"
        assert "outside the shared directory" in str(ei.value)
    assert leftovers(shared) == []


@pytest.mark.parametrize("fault", ["http_500", "missing_file", "truncated", "bad_json", "stale_lock"])
async def test_transient_faults_are_retried(tmp_path, fault):
    shared = tmp_path / "shm"
    mode = "lock" if fault == "stale_lock" else "sync"
    fake = FakeVLLM(FakeConfig(str(shared), faults=[fault], mode=mode, write_delay_s=0.01))
    async with fake as url:
        cfg = client_cfg(url, shared, max_retries=2, lock_timeout_s=0.3, file_wait_s=0.3)
        async with HiddenStateClient(cfg) as c:
            s = await c.fetch(PROMPT)
    assert s.attempts == 2 and fake.requests == 2
    np.testing.assert_array_equal(s.hidden_states, expected_states(PROMPT.token_ids, 3, 8))
    assert leftovers(shared) == []


async def test_retries_exhausted(tmp_path):
    shared = tmp_path / "shm"
    fake = FakeVLLM(FakeConfig(str(shared), faults=["http_500"] * 10))
    async with (
        fake as url,
        HiddenStateClient(client_cfg(url, shared, max_retries=2, breaker_threshold=100)) as c,
    ):
        with pytest.raises(FetchError) as ei:
            await c.fetch(PROMPT)
    assert ei.value.reason == "http_500" and ei.value.transient and ei.value.attempts == 3
    assert fake.requests == 3


async def test_timeout_is_transient(tmp_path):
    shared = tmp_path / "shm"
    fake = FakeVLLM(FakeConfig(str(shared), faults=["hang"]))
    async with (
        fake as url,
        HiddenStateClient(client_cfg(url, shared, request_timeout_s=0.3, max_retries=1)) as c,
    ):
        s = await c.fetch(PROMPT)
    assert s.attempts == 2


async def test_api_key(tmp_path):
    shared = tmp_path / "shm"
    async with (
        FakeVLLM(FakeConfig(str(shared), api_key="sekret")) as url,
        HiddenStateClient(client_cfg(url, shared, api_key="sekret")) as c,
    ):
        assert (await c.fetch(PROMPT)).num_tokens == 4
        async with HiddenStateClient(client_cfg(url, shared, api_key="wrong")) as c:
            with pytest.raises(FatalError) as ei:
                await c.fetch(PROMPT)
    assert ei.value.reason == "unauthorized" and "api-key" in str(ei.value)


async def test_least_loaded_routing_and_breaker(tmp_path):
    shared = tmp_path / "shm"
    slow = FakeVLLM(FakeConfig(str(shared), latency_s=0.2))
    fast = FakeVLLM(FakeConfig(str(shared), latency_s=0.0))
    async with slow as u1, fast as u2, HiddenStateClient(client_cfg([u1, u2], shared)) as c:
        prompts = [RenderedPrompt(f"p{i}", [i + 1, 2, 3], [1, 1, 1]) for i in range(40)]
        out = await asyncio.gather(*(c.fetch(p) for p in prompts))
        assert {s.sample_id for s in out} == {p.sample_id for p in prompts}
        # both used; the fast one takes more since its in-flight count drops sooner
        assert slow.requests >= 1 and fast.requests >= 1
    # breaker: an endpoint failing every time opens and traffic moves to the healthy one
    bad = FakeVLLM(FakeConfig(str(shared), faults=["http_500"] * 1000))
    good = FakeVLLM(FakeConfig(str(shared)))
    async with bad as u1, good as u2:
        cfg = client_cfg([u1, u2], shared, breaker_threshold=2, breaker_cooldown_s=60, max_retries=3)
        async with HiddenStateClient(cfg) as c:
            for i in range(10):
                s = await c.fetch(RenderedPrompt(f"q{i}", [i + 1], [1]), endpoint=u1)
                assert s.endpoint == u2
            assert c.stats()[u1]["breaker"] == "open"
        assert bad.requests == 2, "an open breaker must stop requests to the failing server"
    assert leftovers(shared) == []


def test_circuit_breaker_states():
    b = CircuitBreaker(threshold=2, cooldown_s=1.0)
    assert b.state(0) == "closed"
    b.on_failure(0)
    assert b.allows(0)
    b.on_failure(0)
    assert b.state(0.5) == "open" and not b.allows(0.5)
    assert b.state(1.5) == "half_open" and b.allows(1.5)
    b.on_start(1.5)
    assert not b.allows(1.6), "only one probe while half-open"
    b.on_failure(1.6)
    assert b.state(2.5) == "open", "a failed probe re-opens for a doubled cooldown"
    assert b.state(3.7) == "half_open"
    b.on_start(3.7)
    b.on_success()
    assert b.state(3.8) == "closed"


def test_all_finite_bit_patterns():
    import ml_dtypes

    a = np.ones((3, 5), dtype=ml_dtypes.bfloat16)
    assert all_finite(a.view(np.uint16), "bfloat16")
    for bad in (np.nan, np.inf, -np.inf):
        b = a.copy()
        b[2, 4] = bad
        assert not all_finite(b.view(np.uint16), "bfloat16", chunk=4)
    h = np.ones(10, dtype=np.float16)
    h[7] = np.inf
    assert not all_finite(h, "float16")
    f = np.zeros(10, dtype=np.float32)
    assert all_finite(f, "float32")
    f[3] = np.nan
    assert not all_finite(f, "float32")


def test_endpoint_normalization():
    assert normalize_endpoint("http://h:8000/v1/") == "http://h:8000"
    assert normalize_endpoint("h:8000") == "http://h:8000"
    with pytest.raises(ValueError):
        ClientConfig(endpoints=["http://a", "http://a/v1"])


async def test_include_output_tokens_rows_dropped(tmp_path):
    """With include_output_tokens the file may hold extra rows: only the prompt's are kept."""
    shared = tmp_path / "shm"
    fake = FakeVLLM(FakeConfig(str(shared)))
    orig = fake.completions_handler

    async def extended(request):
        resp = await orig(request)
        import json

        body = json.loads(resp.text)
        path = body["kv_transfer_params"]["hidden_states_path"]
        ids = body["choices"][0]["prompt_token_ids"] + [99]
        from fake_vllm import write_states_file

        write_states_file(path, expected_states(ids, 3, 8), np.asarray(ids), "float32")
        return resp

    fake.completions_handler = extended
    async with fake as url, HiddenStateClient(client_cfg(url, shared, include_output_tokens=True)) as c:
        s = await c.fetch(PROMPT)
        assert s.hidden_states.shape == (4, 3, 8)
        async with HiddenStateClient(client_cfg(url, shared)) as c:
            with pytest.raises(FetchError, match="token_mismatch"):
                await c.fetch(PROMPT)


async def test_a_model_the_server_does_not_serve_is_refused_before_any_request(tmp_path):
    """Issue 23: generate's --model is the served model id to request (vLLM's API), not the
    weights (serve's --model); a name no server lists ends the probe in one line naming the flag."""
    shared = tmp_path / "shm"
    fake = FakeVLLM(FakeConfig(str(shared)))
    async with fake as url:
        async with HiddenStateClient(client_cfg(url, shared, model=fake.cfg.model)) as c:
            assert await c.probe() == {url: fake.cfg.model}
        async with HiddenStateClient(client_cfg(url, shared, model="Qwen/Qwen3-8B")) as c:
            with pytest.raises(FatalError, match=r"--model Qwen/Qwen3-8B: .* serves \[") as e:
                await c.probe()
    assert fake.cfg.model in str(e.value) and fake.requests == 0
