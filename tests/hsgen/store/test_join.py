"""Joined generators (``--join``): many writers on one store, each prompt requested about once,
each sample stored once, a killed writer's chunks picked up by the others (issue 24)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
from _join_writer import prompts
from fake_vllm import FakeConfig, FakeVLLM
from test_generate import check_store, gen_cfg, make_store

from hsgen.client.saturate import SaturationConfig
from hsgen.generate.pipeline import EXIT_OK, generate
from hsgen.store import HiddenStateStore
from hsgen.store.leases import LeaseConflict, acquire_lease

WRITER = Path(__file__).parents[1] / "_join_writer.py"


def test_joined_and_plain_generators_refuse_each_other(tmp_path):
    a = acquire_lease(tmp_path / "st", world_size=1, rank=0, request_prefix="hsgen-aaaaaaaaaaaa-", join=True)
    b = acquire_lease(tmp_path / "st", world_size=1, rank=0, request_prefix="hsgen-bbbbbbbbbbbb-", join=True)
    with pytest.raises(LeaseConflict, match="add --join"):
        acquire_lease(tmp_path / "st", world_size=1, rank=0, request_prefix="hsgen-cccccccccccc-")
    a.release()
    b.release()
    plain = acquire_lease(tmp_path / "st", world_size=1, rank=0, request_prefix="hsgen-dddddddddddd-")
    with pytest.raises(LeaseConflict, match="did not --join"):
        acquire_lease(tmp_path / "st", world_size=1, rank=0, request_prefix="hsgen-eeeeeeeeeeee-", join=True)
    plain.release()


async def test_two_joined_generators_share_the_work(tmp_path):
    shared = tmp_path / "shm"
    store_a, store_b = make_store(tmp_path / "st"), HiddenStateStore.open(tmp_path / "st")
    ps = prompts(240)
    fake = FakeVLLM(FakeConfig(str(shared), latency_s=0.002))
    async with fake as url:
        cfgs = [
            gen_cfg(url, shared, join=True, join_chunk=16, saturation=SaturationConfig(concurrency=4))
            for _ in range(2)
        ]
        a, b = await asyncio.gather(
            generate(cfgs[0], ps, store_a, progress=False), generate(cfgs[1], ps, store_b, progress=False)
        )
    assert a.exit_code == b.exit_code == EXIT_OK
    assert a.stored + b.stored == 240 and a.stored > 0 and b.stored > 0
    assert a.other_writer + b.other_writer == 240
    counts = Counter(str(ids) for ids in fake.completions)
    assert fake.requests == 240 and max(counts.values()) == 1, "each prompt requested once"
    store = HiddenStateStore.open(tmp_path / "st")
    assert len(store) == 240 and store.stats()["duplicates"] == 0
    check_store(store, ps)


@pytest.mark.slow
def test_a_killed_joined_writer_is_picked_up(tmp_path):
    shared, store_path = tmp_path / "shm", tmp_path / "st"
    make_store(store_path)
    n = 240
    fake = FakeVLLM(FakeConfig(str(shared), latency_s=0.01))
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(WRITER.parent), os.environ.get("PYTHONPATH", "")]),
    }
    with fake.in_thread() as url:
        args = [sys.executable, str(WRITER), url, str(shared), str(store_path), str(n), "16"]
        victim = subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        helper = subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        store = HiddenStateStore.open(store_path)
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline and victim.poll() is None:
            store.refresh()
            # both writers have committed (one manifest per writer): under load the helper alone may
            # commit the first 60, and a victim killed before its first commit leaves nothing to keep
            if len(store) >= 60 and len(store.stats()["writer_ids"]) >= 2:
                break
            time.sleep(0.05)
        assert victim.poll() is None, "the victim ended before it could be killed"
        victim.send_signal(signal.SIGKILL)
        victim.wait(30)
        out, err = helper.communicate(timeout=600)
    assert helper.returncode == EXIT_OK, err[-3000:]
    summary = json.loads(out.strip().splitlines()[-1])
    store = HiddenStateStore.open(store_path)
    assert len(store) == n and store.stats()["duplicates"] == 0, "every sample stored once"
    assert summary["stored"] < n, "the victim's committed samples were kept"
    check_store(store, prompts(n))
    counts = Counter(str(ids) for ids in fake.completions)
    assert len(counts) == n
    print(f"{fake.requests} requests for {n} samples")
    assert fake.requests <= 1.15 * n, f"{fake.requests} requests for {n} samples"


def test_two_hsgen_generate_join_processes(tmp_path):
    """``hsgen generate --join`` twice on one store (the CLI, two processes): each prompt
    requested about once, each sample stored once."""
    shared, store_path = tmp_path / "shm", tmp_path / "st"
    data = tmp_path / "d.jsonl"
    n = 160
    data.write_text(
        "".join(json.dumps({"id": f"p{i}", "input_ids": [i + 1, i + 2, 3]}) + "\n" for i in range(n))
    )
    fake = FakeVLLM(FakeConfig(str(shared), latency_s=0.01))
    with fake.in_thread() as url:
        args = [sys.executable, "-m", "hsgen.cli", "generate", str(data), "--store", str(store_path)]
        args += ["--endpoint", url, "--shared-dir", str(shared), "--layer-ids", "1,2,4", "--no-progress"]
        args += ["--join", "--join-chunk", "16", "--concurrency", "4", "--log-level", "WARNING"]
        procs = [
            subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in "ab"
        ]
        outs = [p.communicate(timeout=600) for p in procs]
    for p, (_out, err) in zip(procs, outs, strict=True):
        assert p.returncode == EXIT_OK, err[-3000:]
    summaries = [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]
    store = HiddenStateStore.open(store_path)
    assert len(store) == n and store.stats()["duplicates"] == 0
    assert sum(s["stored"] for s in summaries) == n
    assert fake.requests <= 1.15 * n, f"{fake.requests} requests for {n} samples"
