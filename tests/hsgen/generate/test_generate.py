"""The generate pipeline into a real store, against the scripted fake vLLM; and the CLI."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys

import numpy as np
from click.testing import CliRunner
from fake_vllm import FakeConfig, FakeVLLM, expected_states

from hsgen.client.config import ClientConfig
from hsgen.client.saturate import SaturationConfig
from hsgen.generate.pipeline import (
    EXIT_FAILURE,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_PARTIAL,
    GenerateConfig,
    Skipped,
    generate,
    rank_of,
)
from hsgen.inputs.render import RenderedPrompt
from hsgen.store import HiddenStateStore, StoreHeader

LAYERS = (1, 2, 4)


def prompts(n: int, start: int = 1) -> list[RenderedPrompt]:
    out = []
    for i in range(start, start + n):
        ids = [i, i + 1, i + 2, (i * 7) % 50 + 1]
        out.append(RenderedPrompt(f"s{i:04d}", ids, [0, 1, 1, 1]))
    return out


def make_store(path, hidden=8, dtype="float32") -> HiddenStateStore:
    return HiddenStateStore.create(path, StoreHeader("fake-model", LAYERS, hidden, dtype))


def gen_cfg(url, shared, **kw) -> GenerateConfig:
    client_kw = {k: kw.pop(k) for k in list(kw) if k in ClientConfig.__dataclass_fields__}
    client = ClientConfig(
        endpoints=url if isinstance(url, list) else [url],
        shared_dir=str(shared),
        backoff_s=0.01,
        file_wait_s=0.5,
        lock_timeout_s=0.5,
        settle_s=0.1,
        request_timeout_s=5,
        **client_kw,
    )
    return GenerateConfig(client=client, shard_bytes=kw.pop("shard_bytes", 2048), **kw)


def check_store(store: HiddenStateStore, ps: list[RenderedPrompt]) -> None:
    store.refresh()
    assert store.verify() == []
    for p in ps:
        s = store.read(p.sample_id)
        assert s.token_ids.tolist() == p.token_ids
        assert s.loss_mask.tolist() == p.loss_mask
        np.testing.assert_array_equal(s.hidden_states, expected_states(p.token_ids, 3, 8))


async def test_generate_then_resume(tmp_path):
    shared = tmp_path / "shm"
    store = make_store(tmp_path / "store")
    ps = prompts(60)
    fake = FakeVLLM(FakeConfig(str(shared), mode="lock", write_delay_s=0.005))
    async with fake as url:
        s1 = await generate(gen_cfg(url, shared), ps[:40], store, progress=False)
        assert (s1.status, s1.exit_code, s1.stored, s1.failed) == ("ok", EXIT_OK, 40, 0)
        assert s1.tokens == 160 and s1.bytes == 40 * 4 * 3 * 8 * 4
        s2 = await generate(gen_cfg(url, shared), ps + ps[:5], store, progress=False)
    assert s2.already_done == 40 and s2.stored == 20 and s2.duplicates == 5
    assert fake.requests == 60, "resume must not request stored samples again"
    check_store(store, ps)
    assert os.listdir(shared) == []


async def test_rows_are_landed_from_the_servers_file_and_the_time_accounted(tmp_path):
    """Issue 33: the client leaves the rows in the server's (unlinked) file and the writer copies
    them into the shard, checking them as they pass; the summary says where the time went."""
    from hsgen.client.hidden_file import _OpenFile

    shared = tmp_path / "shm"
    store = make_store(tmp_path / "store")
    ps = prompts(30)
    nan = {ps[4].token_ids[0]: "nan"}
    async with FakeVLLM(FakeConfig(str(shared), fault_by_first_token=nan)) as url:
        s = await generate(gen_cfg(url, shared, shard_bytes=4096), ps, store, progress=False)
    assert (s.stored, s.failed, s.failure_reasons) == (29, 1, {"non_finite": 1})
    check_store(store, [p for p in ps if p is not ps[4]])
    assert {"read", "check_finite", "checksum", "write", "fsync_files", "manifest", "validate"} <= set(
        s.phases
    )
    assert _OpenFile.held == 0 and os.listdir(shared) == []  # every server file released and removed


async def test_rank_split_is_deterministic_and_complete(tmp_path):
    shared = tmp_path / "shm"
    store = make_store(tmp_path / "store")
    ps = prompts(50)
    async with FakeVLLM(FakeConfig(str(shared))) as url:
        got = []
        for rank in range(3):
            s = await generate(gen_cfg(url, shared, world_size=3, rank=rank), ps, store, progress=False)
            got.append(s.stored)
            assert s.other_rank == 50 - s.stored
    assert sum(got) == 50 and all(g > 5 for g in got)
    assert [rank_of(p.sample_id, 3) for p in ps] == [rank_of(p.sample_id, 3) for p in ps]
    check_store(store, ps)


async def test_failures_file_and_partial_exit(tmp_path):
    shared = tmp_path / "shm"
    store = make_store(tmp_path / "store")
    ps = prompts(20)
    faults = {ps[3].token_ids[0]: "nan", ps[7].token_ids[0]: "http_400", ps[9].token_ids[0]: "token_mismatch"}
    failures = tmp_path / "fail.jsonl"
    items = [*ps, Skipped("bad_input", "data.jsonl:3: no prompt found", None, "data.jsonl:3")]
    async with FakeVLLM(FakeConfig(str(shared), fault_by_first_token=faults)) as url:
        s = await generate(gen_cfg(url, shared, failures_path=str(failures)), items, store, progress=False)
    assert (s.status, s.exit_code, s.stored, s.failed, s.bad_input) == ("partial", EXIT_PARTIAL, 17, 3, 1)
    lines = [json.loads(x) for x in failures.read_text().splitlines()]
    by_id = {x["sample_id"]: x["reason"] for x in lines}
    assert by_id == {"s0004": "non_finite", "s0008": "http_400", "s0010": "token_mismatch", None: "bad_input"}
    store.refresh()
    assert "s0004" not in store and len(store) == 17
    assert store.verify() == []


async def test_transient_faults_are_retried_into_the_store(tmp_path):
    shared = tmp_path / "shm"
    store = make_store(tmp_path / "store")
    ps = prompts(30)
    faults = ["http_500", None, "truncated", None, "missing_file", "bad_json"] * 3
    async with FakeVLLM(FakeConfig(str(shared), faults=faults)) as url:
        s = await generate(gen_cfg(url, shared, max_retries=3), ps, store, progress=False)
    assert s.exit_code == EXIT_OK and s.stored == 30 and s.retries >= 12
    check_store(store, ps)


async def test_retries_counter_counts_every_retry(tmp_path):
    """The summary's ``retries`` counts the retries of stored and of failed prompts, exactly."""
    shared = tmp_path / "shm"
    store = make_store(tmp_path / "store")
    ps = prompts(5)
    failures = tmp_path / "fail.jsonl"
    faults = ["http_500", "http_500", None]  # s0001: stored after 2 retries
    faults += ["http_503", None]  # s0002: 1 retry
    faults += ["http_400"]  # s0003: permanent, no retry
    faults += ["http_500"] * 3  # s0004: retries exhausted (2)
    faults += [None]  # s0005
    async with FakeVLLM(FakeConfig(str(shared), faults=faults)) as url:
        cfg = gen_cfg(url, shared, max_retries=2, saturation=SaturationConfig(concurrency=1),
                      failures_path=str(failures))  # fmt: skip
        s = await generate(cfg, ps, store, progress=False)
    assert (s.stored, s.failed, s.retries) == (3, 2, 5)
    lines = {x["sample_id"]: x for x in map(json.loads, failures.read_text().splitlines())}
    assert (lines["s0003"]["reason"], lines["s0003"]["attempts"]) == ("http_400", 1)
    assert (lines["s0004"]["reason"], lines["s0004"]["attempts"]) == ("http_500", 3)


async def test_all_fail_is_failure_and_fatal_aborts(tmp_path):
    shared = tmp_path / "shm"
    store = make_store(tmp_path / "store")
    async with FakeVLLM(FakeConfig(str(shared), faults=["http_400"] * 10)) as url:
        s = await generate(gen_cfg(url, shared), prompts(10), store, progress=False)
    assert (s.exit_code, s.status, s.failed) == (EXIT_FAILURE, "failed", 10)
    async with FakeVLLM(FakeConfig(str(shared), api_key="k")) as url:
        fake_prompts = prompts(500)
        s = await generate(gen_cfg(url, shared, api_key="bad"), fake_prompts, store, progress=False)
    assert s.exit_code == EXIT_FAILURE and "unauthorized" in s.fatal
    assert s.failed < 500, "a fatal error must stop the run instead of failing every prompt"


async def test_store_mismatch_is_fatal(tmp_path):
    shared = tmp_path / "shm"
    store = make_store(tmp_path / "store", hidden=16)
    async with FakeVLLM(FakeConfig(str(shared))) as url:
        s = await generate(gen_cfg(url, shared), prompts(5), store, progress=False)
    assert s.exit_code == EXIT_FAILURE and "hidden size 8" in s.fatal
    store.refresh()
    assert len(store) == 0


async def test_store_factory_creates_from_first_sample(tmp_path):
    shared = tmp_path / "shm"
    path = tmp_path / "store"

    def factory(sample):
        return HiddenStateStore.create(
            path, StoreHeader("m", LAYERS, sample.hidden_states.shape[2], sample.dtype)
        )

    async with FakeVLLM(FakeConfig(str(shared), dtype="bfloat16")) as url:
        s = await generate(gen_cfg(url, shared), prompts(7), factory, progress=False)
    assert s.stored == 7
    st = HiddenStateStore.open(path)
    assert st.header.dtype == "bfloat16" and st.header.hidden_size == 8 and len(st) == 7


async def test_stop_commits_what_is_complete(tmp_path):
    shared = tmp_path / "shm"
    store = make_store(tmp_path / "store")
    ps = prompts(400)
    stop = asyncio.Event()
    async with FakeVLLM(FakeConfig(str(shared), latency_s=0.01)) as url:
        cfg = gen_cfg(url, shared, saturation=SaturationConfig(concurrency=4), shard_bytes=1 << 30)
        task = asyncio.create_task(generate(cfg, ps, store, progress=False, stop=stop))
        await asyncio.sleep(0.4)
        stop.set()
        s = await task
    assert s.status == "interrupted" and s.exit_code == EXIT_INTERRUPTED
    assert 0 < s.stored < 400
    store.refresh()
    assert len(store) == s.stored and store.verify() == []
    assert os.listdir(shared) == [], "in-flight requests finish and clean up after a stop"


async def test_memory_bound_backpressure(tmp_path):
    """With a tiny buffer, requests in flight plus buffered samples stay bounded."""
    shared = tmp_path / "shm"
    store = make_store(tmp_path / "store")
    fake = FakeVLLM(FakeConfig(str(shared)))
    peak = {"in_flight": 0}
    orig = fake.completions_handler
    live = {"n": 0}

    async def counting(request):
        live["n"] += 1
        peak["in_flight"] = max(peak["in_flight"], live["n"])
        try:
            return await orig(request)
        finally:
            live["n"] -= 1

    fake.completions_handler = counting
    async with fake as url:
        cfg = gen_cfg(url, shared, saturation=SaturationConfig(concurrency=3), max_buffer_bytes=1)
        s = await generate(cfg, prompts(30), store, progress=False)
    assert s.stored == 30 and peak["in_flight"] <= 3


async def test_fixed_concurrency_is_respected(tmp_path):
    shared = tmp_path / "shm"
    store = make_store(tmp_path / "store")
    async with FakeVLLM(FakeConfig(str(shared), capacity=64, step_s=0.02)) as url:
        fake_seen = []
        cfg = gen_cfg(url, shared, saturation=SaturationConfig(concurrency=5))
        task = asyncio.create_task(generate(cfg, prompts(100), store, progress=False))
        while not task.done():
            await asyncio.sleep(0.005)
            fake_seen.append(len(os.listdir(shared)))
        s = await task
    assert s.stored == 100 and s.endpoints[url]["limit"] == 5 and s.endpoints[url]["mode"] == "fixed"


def test_cli_render_pipe_generate(tmp_path, tiny_model_dir, sample_chats_path):
    """``hsgen render ... | hsgen generate -`` lands the same samples as a direct generate."""
    shared = tmp_path / "shm"
    data = tmp_path / "chats.jsonl"
    data.write_text("".join(sample_chats_path.read_text().splitlines(keepends=True)[:12]))
    runner = CliRunner()
    from hsgen.cli.generate import generate as gen_cmd
    from hsgen.cli.generate import render as render_cmd

    r = runner.invoke(render_cmd, [str(data), "--tokenizer", str(tiny_model_dir), "--max-len", "64"])
    assert r.exit_code == 0, r.output
    rendered = [json.loads(x) for x in r.stdout.splitlines() if x.startswith("{")]
    assert len(rendered) == 12 and all(len(x["input_ids"]) <= 64 for x in rendered)
    with FakeVLLM(FakeConfig(str(shared))).in_thread() as url:
        r = runner.invoke(
            gen_cmd,
            ["-", "--store", str(tmp_path / "st"), "--endpoint", url, "--shared-dir", str(shared)]
            + ["--layer-ids", "1,2,4", "--no-progress", "--log-level", "WARNING"],
            input="\n".join(json.dumps(x) for x in rendered) + "\n",
        )
        assert r.exit_code == 0, r.output
        summary = json.loads(r.stdout.strip().splitlines()[-1])
        assert summary["stored"] == 12 and summary["exit_code"] == 0
        # a direct run over the conversations resumes into the same ids: nothing new
        r = runner.invoke(
            gen_cmd,
            [str(data), "--store", str(tmp_path / "st"), "--endpoint", url, "--shared-dir", str(shared)]
            + [
                "--tokenizer",
                str(tiny_model_dir),
                "--max-len",
                "64",
                "--no-progress",
                "--log-level",
                "WARNING",
            ],
        )
        assert r.exit_code == 0, r.output
        summary = json.loads(r.stdout.strip().splitlines()[-1])
        assert summary["already_done"] == 12 and summary["stored"] == 0
    st = HiddenStateStore.open(tmp_path / "st")
    assert sorted(st.sample_ids()) == sorted(x["id"] for x in rendered)
    for x in rendered:
        s = st.read(x["id"])
        assert s.token_ids.tolist() == x["input_ids"] and s.loss_mask.tolist() == x["loss_mask"]


def test_cli_errors(tmp_path):
    from hsgen.cli.generate import generate as gen_cmd

    data = tmp_path / "d.jsonl"
    data.write_text('{"input_ids": [1, 2]}\n{"oops": 1}\n')
    runner = CliRunner()
    r = runner.invoke(
        gen_cmd, [str(data), "--store", str(tmp_path / "st"), "--endpoint", "http://127.0.0.1:9"]
    )
    assert r.exit_code != 0 and "--layer-ids" in r.output
    r = runner.invoke(
        gen_cmd,
        [str(data), "--store", str(tmp_path / "st"), "--endpoint", "h:1", "--layer-ids", "1", "--rank", "2"],
    )
    assert r.exit_code != 0 and "--rank" in r.output


def test_cli_bad_input_fail_names_line(tmp_path):
    shared = tmp_path / "shm"
    data = tmp_path / "d.jsonl"
    data.write_text('{"input_ids": [1, 2]}\n{"oops": 1}\n{"input_ids": [3]}\n')
    from hsgen.cli.generate import generate as gen_cmd

    with FakeVLLM(FakeConfig(str(shared))).in_thread() as url:
        base = [str(data), "--store", str(tmp_path / "st"), "--endpoint", url, "--shared-dir", str(shared)]
        base += ["--layer-ids", "1,2,4", "--no-progress", "--log-level", "ERROR"]
        r = CliRunner().invoke(gen_cmd, base)
        summary = json.loads(r.stdout.strip().splitlines()[-1])
        assert r.exit_code == EXIT_FAILURE and f"{data}:2" in summary["fatal"]
        r = CliRunner().invoke(gen_cmd, [*base, "--on-bad-input", "skip"])
        summary = json.loads(r.stdout.strip().splitlines()[-1])
        assert r.exit_code == 0 and summary["bad_input"] == 1 and summary["stored"] == 1
        fails = (tmp_path / "st.failures.jsonl").read_text()
        assert f"{data}:2" in fails


def test_no_torch_import():
    """The client side never imports torch (``import transformers`` would)."""
    code = (
        "import sys, hsgen, hsgen.client.fetch, hsgen.generate.pipeline, hsgen.inputs.render, hsgen.store, hsgen.inputs.formats, "
        "hsgen.client.saturate, hsgen.cli.generate\n"
        "bad = [m for m in ('torch', 'transformers') if m in sys.modules]\n"
        "print(bad); sys.exit(1 if bad else 0)"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
