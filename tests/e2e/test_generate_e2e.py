"""hsgen generate against the reference server (``hsgen serve``): store, verify, faults, kill -9."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from hsgen.client.fetch import ClientConfig, HiddenStateClient
from hsgen.inputs.render import ChatRenderer, RenderConfig
from hsgen.serve.testing import running_server
from hsgen.store import HiddenStateStore

LAYERS = [1, 2, 4]


@pytest.fixture()
def chats(tmp_path, sample_chats_path):
    def make(n: int):
        p = tmp_path / f"chats{n}.jsonl"
        p.write_text("".join(sample_chats_path.read_text().splitlines(keepends=True)[:n]))
        return p

    return make


def run_generate(data, store, url, shared, tiny, *extra, timeout=600):
    args = [sys.executable, "-m", "hsgen.cli", "generate", str(data), "--store", str(store)]
    args += ["--endpoint", url, "--shared-dir", str(shared), "--layer-ids", ",".join(map(str, LAYERS))]
    args += ["--tokenizer", str(tiny), "--max-len", "256", "--no-progress", "--log-level", "WARNING", *extra]
    r = subprocess.run(args, capture_output=True, text=True, timeout=timeout)
    summary = json.loads(r.stdout.strip().splitlines()[-1]) if r.stdout.strip() else None
    return r, summary


@pytest.mark.parametrize("version", ["0.18", "0.22", "0.24"])
async def test_generate_store_matches_direct_fetch(tmp_path, chats, tiny_model_dir, version):
    shared = tmp_path / "shm"
    data = chats(24)
    with running_server("tiny", LAYERS, shared, vllm_version=version, dtype="float32") as url:
        r, summary = run_generate(data, tmp_path / "st", url, shared, tiny_model_dir)
        assert r.returncode == 0, r.stderr[-3000:]
        assert summary["stored"] == 24 and summary["failed"] == 0
        store = HiddenStateStore.open(tmp_path / "st")
        assert store.verify() == []
        h = store.header
        assert list(h.layer_ids) == LAYERS and h.hidden_size == 64 and len(h.tokenizer_fingerprint) == 64
        renderer = ChatRenderer(RenderConfig(tokenizer_path=str(tiny_model_dir), max_len=256))
        from hsgen.inputs.formats import read_inputs

        samples = [renderer.render(s) for s in read_inputs([data])]
        cfg = ClientConfig(endpoints=[url], shared_dir=str(shared))
        async with HiddenStateClient(cfg) as c:
            for p in samples[:4]:
                direct = await c.fetch(p)
                stored = store.read(p.sample_id)
                assert stored.token_ids.tolist() == p.token_ids
                assert stored.loss_mask.tolist() == p.loss_mask
                # batched vs single forward: float32 rounding differs in the last bits only
                np.testing.assert_allclose(stored.hidden_states, direct.hidden_states, rtol=1e-4, atol=1e-6)
    assert os.listdir(shared) == [], "every server file and lock is removed"


def test_faults_never_store_corrupt_samples(tmp_path, chats, tiny_model_dir):
    shared = tmp_path / "shm"
    data = chats(40)
    faults = "http_500=0.15,missing_file=0.1,truncated_file=0.1,nan=0.1:3,token_mismatch=0.1:3,stale_lock=0.05:2,seed=5"
    with running_server("tiny", LAYERS, shared, faults=faults) as url:
        r, summary = run_generate(
            data,
            tmp_path / "st",
            url,
            shared,
            tiny_model_dir,
            "--lock-timeout",
            "1",
            "--file-wait",
            "2",
            "--retries",
            "4",
            "--breaker-threshold",
            "50",
        )
    assert r.returncode in (0, 3), r.stderr[-3000:]
    assert summary["stored"] + summary["failed"] == 40
    assert set(summary["failure_reasons"]) <= {
        "non_finite",
        "token_mismatch",
        "http_500",
        "missing_file",
        "truncated_file",
        "lock_timeout",
    }
    assert summary["retries"] > 0
    store = HiddenStateStore.open(tmp_path / "st")
    assert store.verify() == [] and len(store) == summary["stored"]
    for sid in store.sample_ids():
        s = store.read(sid)
        assert np.isfinite(s.hidden_states.astype(np.float32)).all()
    fails = (
        [json.loads(x) for x in (tmp_path / "st.failures.jsonl").read_text().splitlines()]
        if summary["failed"]
        else []
    )
    assert len(fails) == summary["failed"] and all(f["sample_id"] not in store for f in fails)


def _killable_generate(data, store_path, url, shared, tiny) -> list[str]:
    """A slow-enough ``hsgen generate`` command line (small shards) to kill mid-run."""
    args = [sys.executable, "-m", "hsgen.cli", "generate", str(data), "--store", str(store_path)]
    args += ["--endpoint", url, "--shared-dir", str(shared), "--layer-ids", "1,2,4", "--tokenizer", str(tiny)]
    return args + ["--shard-mb", "0.2", "--no-progress", "--log-level", "ERROR"]


def test_resume_after_kill_9(tmp_path, chats, tiny_model_dir):
    shared = tmp_path / "shm"
    data = chats(120)
    store_path = tmp_path / "st"
    capacity = "prefill_tokens_per_s=20000,max_concurrent_seqs=4,step_overhead_s=0.05"
    with running_server("tiny", LAYERS, shared, capacity=capacity) as url:
        args = _killable_generate(data, store_path, url, shared, tiny_model_dir)
        proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 600
        n = 0
        while time.monotonic() < deadline:
            time.sleep(0.3)
            if store_path.exists():
                try:
                    n = len(HiddenStateStore.open(store_path))
                except Exception:
                    continue
                if n >= 20:
                    break
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        assert 20 <= n < 120, f"kill came too late or too early ({n} samples)"
        store = HiddenStateStore.open(store_path)
        assert store.verify() == []
        before = len(store)
        r, summary = run_generate(data, store_path, url, shared, tiny_model_dir, "--max-len", "100000")
        assert r.returncode == 0, r.stderr[-3000:]
        assert summary["already_done"] == before and summary["stored"] == 120 - before
    store = HiddenStateStore.open(store_path)
    assert len(store) == 120 and store.verify() == []


def _stored(path) -> int:
    try:
        return len(HiddenStateStore.open(path))
    except Exception:  # not created yet
        return 0


def _in_flight_files(shared, planted) -> set[str]:
    return set(os.listdir(shared)) - set(planted)


def test_kill_9_leaves_no_server_file_of_that_client(tmp_path, chats, tiny_model_dir):
    """Issue 14, point 3: after ``kill -9`` of ``hsgen generate``, ``hsgen gc --shared-dir`` and a
    resume remove the files the server wrote for the dead client; another client's files stay."""
    shared, store_path = tmp_path / "shm", tmp_path / "st"
    shared.mkdir()
    planted = [  # another hsgen client's request, its lock, and a file of a non-hsgen client
        "cmpl-hsgen-0f0f0f0f0f0f-0123456789abcdef-0-cccccccc.safetensors",
        "cmpl-hsgen-0f0f0f0f0f0f-0123456789abcdef-0-cccccccc.safetensors.lock",
        "cmpl-0123456789abcdef-0-dddddddd.safetensors",
    ]
    for name in planted:
        (shared / name).write_bytes(b"not ours")
    data = chats(120)
    capacity = "prefill_tokens_per_s=20000,max_concurrent_seqs=4,step_overhead_s=0.05"
    with running_server("tiny", LAYERS, shared, capacity=capacity) as url:
        args = _killable_generate(data, store_path, url, shared, tiny_model_dir)
        for kill_round in (1, 2):
            proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            deadline = time.monotonic() + 600
            while time.monotonic() < deadline:
                time.sleep(0.1)
                if len(_in_flight_files(shared, planted)) >= 2 and _stored(store_path) >= 10 * kill_round:
                    break
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
            time.sleep(1.0)  # the server aborts or finishes the dead client's requests
            assert _in_flight_files(shared, planted), "the kill left no server file: the test proves nothing"
            if kill_round == 1:
                r = subprocess.run(
                    [sys.executable, "-m", "hsgen.cli", "gc", str(store_path), "--shared-dir", str(shared)],
                    capture_output=True,
                    text=True,
                    timeout=600,
                )
                assert r.returncode == 0, r.stderr
                assert sorted(os.listdir(shared)) == sorted(planted), r.stdout
        r, summary = run_generate(data, store_path, url, shared, tiny_model_dir, "--max-len", "100000")
        assert r.returncode == 0, r.stderr[-3000:]
        assert summary["orphans_removed"] >= 1
    assert sorted(os.listdir(shared)) == sorted(planted)
    store = HiddenStateStore.open(store_path)
    assert len(store) == 120 and store.verify() == []


def test_generate_targets_argmax_stores_the_verifiers_greedy_tokens(tmp_path, chats, tiny_model_dir):
    """``--targets argmax``: the server captures the draft's input layers only; the store keeps the
    verifier's greedy next token per position, equal to transformers' own argmax of the logits."""
    import torch
    from transformers import AutoModelForCausalLM

    shared = tmp_path / "shm"
    data = chats(8)
    aux = [1, 2]
    with running_server("tiny", aux, shared, dtype="float32") as url:
        args = [sys.executable, "-m", "hsgen.cli", "generate", str(data), "--store", str(tmp_path / "st"),
                "--endpoint", url, "--shared-dir", str(shared), "--layer-ids", "1,2", "--targets", "argmax",
                "--tokenizer", str(tiny_model_dir), "--max-len", "256", "--no-progress", "--log-level", "WARNING"]  # fmt: skip
        r = subprocess.run(args, capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stderr[-3000:]
        assert json.loads(r.stdout.strip().splitlines()[-1])["stored"] == 8
        states = [("states" if a == "argmax" else a) for a in args]
        again = subprocess.run(states, capture_output=True, text=True, timeout=600)
        assert again.returncode == 2 and "keeps targets 'argmax'" in again.stderr
    store = HiddenStateStore.open(tmp_path / "st")
    assert store.header.targets == "argmax" and store.header.format_version == 3
    assert list(store.header.layer_ids) == aux and store.verify() == []
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).eval()
    for sid in store.sample_ids():
        s = store.read(sid)
        assert s.hidden_states.shape[1] == 2
        with torch.no_grad():
            logits = model(torch.from_numpy(s.token_ids)[None]).logits[0]
        assert s.target_ids.tolist() == logits.argmax(-1).tolist()
    assert os.listdir(shared) == []
