"""hsgen against the real vLLM (CPU build): the protocol field by field beside ``hsgen serve`` on the same
model, ``hsgen generate`` with a kill -9 and a resume, online and mixed training."""

from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import time

import numpy as np
import pytest
from _tier_util import (
    LAYERS,
    assert_alive,
    consumed_ids,
    env,
    generate_cmd,
    last_data_metrics,
    rel_err,
    run_json,
    write_chats,
)

from hsgen.protocol import extraction as protocol
from hsgen.serve.testing import running_server
from hsgen.store import HiddenStateStore

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(3600)]  # fixtures start vLLM and train drafts


def _http(url: str, path: str, body=None, headers=None):
    import json
    import urllib.error
    import urllib.request

    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(f"{url}{path}", data=data, headers={"Content-Type": "application/json",
                                                                     **(headers or {})})  # fmt: skip
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def _prompts(model_dir, n: int) -> list[list[int]]:
    from hsgen.inputs.formats import read_inputs
    from hsgen.inputs.render import ChatRenderer, RenderConfig
    from hsgen.inputs.sample_data import sample_chats_path

    renderer = ChatRenderer(RenderConfig(tokenizer_path=str(model_dir), max_len=512))
    rows = list(read_inputs([sample_chats_path()]))[:n]
    return [renderer.render(r).token_ids for r in rows]


def _lock_held(lock: str) -> bool:
    fd = os.open(lock, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


def _extract(url: str, token_ids: list[int]) -> tuple[dict, dict]:
    """One extraction request as hsgen sends it; returns (response, what was seen at response time)."""
    status, models = _http(url, "/v1/models")
    assert status == 200, models
    body = {
        "model": models["data"][0]["id"],
        "prompt": token_ids,
        "max_tokens": 1,
        "return_token_ids": True,
        "temperature": 0.0,
    }  # vLLM samples by default; hsgen serve is greedy only (docs/serve.md)
    status, resp = _http(url, "/v1/completions", body)
    assert status == 200, resp
    path = resp["kv_transfer_params"]["hidden_states_path"]
    seen = {"lock_exists": os.path.exists(path + ".lock")}
    with open(path + ".lock") as lf:
        fcntl.flock(lf, fcntl.LOCK_SH)  # vLLM's own reader protocol: sleeps until the writer is done
        from safetensors.numpy import load_file

        with open(path, "rb") as f:
            seen["header"] = protocol.read_safetensors_header(f, os.path.getsize(path))
        seen["tensors"] = load_file(path)
    seen["lock_released"] = not _lock_held(path + ".lock")
    time.sleep(0.5)
    seen["left_in_place"] = os.path.exists(path) and os.path.exists(
        path + ".lock"
    )  # the server never deletes
    os.remove(path + ".lock")
    os.remove(path)
    return resp, seen


def test_protocol_field_by_field_against_hsgen_serve(vllm_extract, vllm_model_dir, tmp_path):
    server, shared = vllm_extract
    prompts = _prompts(vllm_model_dir, 4)
    with running_server(vllm_model_dir, LAYERS, tmp_path / "hs", dtype="float32") as ours:
        for ids in prompts:
            real, real_seen = _extract(server.url, ids)
            mine, mine_seen = _extract(ours, ids)
            for resp in (real, mine):
                assert resp["object"] == "text_completion" and resp["choices"][0]["prompt_token_ids"] == ids
                assert resp["choices"][0]["finish_reason"] == "length"
                assert len(resp["choices"][0]["token_ids"]) == 1
            # every field we answer is one vLLM answers (vLLM has a few more: docs/serve.md)
            assert set(mine) <= set(real), set(mine) - set(real)
            assert set(mine["choices"][0]) <= set(real["choices"][0]), set(mine["choices"][0]) - set(
                real["choices"][0]
            )
            for key in ("id", "object", "model", "choices", "usage", "kv_transfer_params"):
                assert key in real and key in mine, key
            assert real["usage"]["prompt_tokens"] == mine["usage"]["prompt_tokens"] == len(ids)
            name = os.path.basename(real["kv_transfer_params"]["hidden_states_path"])
            assert os.path.dirname(real["kv_transfer_params"]["hidden_states_path"]) == str(shared)
            assert name.endswith(".safetensors") and name.startswith("cmpl-")
            for seen in (real_seen, mine_seen):
                assert seen["lock_exists"] and seen["lock_released"] and seen["left_in_place"]
            rh, mh = real_seen["header"], mine_seen["header"]
            assert {k: (v.dtype, v.shape) for k, v in rh.items()} == {
                k: (v.dtype, v.shape) for k, v in mh.items()
            }
            assert rh["hidden_states"].dtype == "float32" and rh["token_ids"].dtype == "int64"
            assert rh["hidden_states"].shape == (len(ids), len(LAYERS), 64)
            assert (
                real_seen["tensors"]["token_ids"].tolist()
                == ids
                == mine_seen["tensors"]["token_ids"].tolist()
            )
            err = rel_err(mine_seen["tensors"]["hidden_states"], real_seen["tensors"]["hidden_states"])
            assert err <= 1e-5, f"hidden states differ by {err:.2e} (relative)"
            assert real["choices"][0]["token_ids"] == mine["choices"][0]["token_ids"]  # the same greedy token
    assert_alive(server)
    assert os.listdir(shared) == []


def test_generate_kill_9_resume_and_compare_with_hsgen_serve(vllm_extract, vllm_model_dir, sample_chats_path,
                                                            tmp_path):  # fmt: skip
    server, shared = vllm_extract
    data = tmp_path / "chats.jsonl"
    n = 120
    write_chats(sample_chats_path, data, n)
    store = tmp_path / "real"
    cmd = generate_cmd(data, store, server.url, shared, vllm_model_dir, LAYERS, "--shard-mb", "0.2")
    # one request at a time, so that the kill lands mid-run even on an idle machine
    proc = subprocess.Popen(
        [*cmd, "--concurrency", "1"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env()
    )
    deadline, stored = time.monotonic() + 300, 0
    while time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.2)
        try:
            stored = len(HiddenStateStore.open(store))
        except Exception:  # not created yet
            continue
        if stored >= 8:
            break
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert 8 <= stored < n, f"the kill came too early or too late ({stored} of {n} stored)"
    assert HiddenStateStore.open(store).verify() == []
    r, summary = run_json(cmd)
    assert r.returncode == 0, r.stderr[-3000:]
    assert summary["stored"] + summary["already_done"] == n and summary["failed"] == 0, summary
    real = HiddenStateStore.open(store)
    assert len(real) == n and real.verify() == []
    time.sleep(1.0)
    assert os.listdir(shared) == [], "the resume removed the killed run's orphans; nothing is left"
    assert_alive(server)

    with running_server(vllm_model_dir, LAYERS, tmp_path / "hs", dtype="float32") as ours:
        r, summary = run_json(
            generate_cmd(data, tmp_path / "ours", ours, ours.shared_dir, vllm_model_dir, LAYERS)
        )
        assert r.returncode == 0, r.stderr[-3000:]
    mine = HiddenStateStore.open(tmp_path / "ours")
    assert sorted(real.sample_ids()) == sorted(mine.sample_ids())
    assert (
        real.header.layer_ids == mine.header.layer_ids and real.header.hidden_size == mine.header.hidden_size
    )
    worst = 0.0
    for sid in real.sample_ids():
        a, b = real.read(sid), mine.read(sid)
        assert a.token_ids.tolist() == b.token_ids.tolist() and a.loss_mask.tolist() == b.loss_mask.tolist()
        assert (
            a.hidden_states.dtype == b.hidden_states.dtype and a.hidden_states.shape == b.hidden_states.shape
        )
        worst = max(worst, rel_err(b.hidden_states.astype(np.float32), a.hidden_states.astype(np.float32)))
    # the store keeps bf16: both sides round the same fp32 values (<= 1e-5 apart) to bf16
    assert worst <= 2**-7, f"stored hidden states differ by {worst:.2e} beyond bf16 rounding"


def _train_cmd(url, prompts, model, tmp, shared, *extra) -> list[str]:
    import sys

    return [
        sys.executable, "-m", "spectrain.cli", "train", "--online", "--endpoint", url, "--prompts", str(prompts),
        "--verifier", str(model), "--save-path", str(tmp / "save"), "--store", str(tmp / "store"),
        "--shared-dir", str(shared), "--scratch-dir", str(tmp / "scratch"),
        "--online-option", f"layer_ids={list(LAYERS)}", "--total-seq-len", "512", "--block-size", "4",
        "--num-layers", "1", "--max-anchors", "16", "--val-fraction", "0", "--device", "cpu", *extra,
    ]  # fmt: skip


def test_train_online_delete_consumed(vllm_extract, vllm_model_dir, sample_chats_path, tmp_path):
    server, shared = vllm_extract
    ids = write_chats(sample_chats_path, tmp_path / "p.jsonl", 24)
    cmd = _train_cmd(server.url, tmp_path / "p.jsonl", vllm_model_dir, tmp_path, shared, "--epochs", "2",
                     "--delete-consumed")  # fmt: skip
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env())
    assert r.returncode == 0, r.stderr[-3000:]
    per_epoch = consumed_ids(tmp_path / "save")
    assert sorted(per_epoch) == [0, 1] and all(sorted(v) == sorted(ids) for v in per_epoch.values())
    data = last_data_metrics(tmp_path / "save")
    assert data["samples_failed"] == 0 and len(ids) <= data["samples_generated"] <= 2 * len(ids), data
    assert not (tmp_path / "scratch").exists(), "every consumed sample was deleted"
    assert os.listdir(shared) == [], "every server file was handed off and removed"
    assert (tmp_path / "save" / "latest").is_file()
    assert_alive(server)


def test_mixed_run_over_a_partial_store(vllm_extract, vllm_model_dir, sample_chats_path, tmp_path):
    server, shared = vllm_extract
    ids = write_chats(sample_chats_path, tmp_path / "p.jsonl", 24)
    write_chats(sample_chats_path, tmp_path / "part.jsonl", 10)  # the first 10 stored beforehand
    r, summary = run_json(generate_cmd(tmp_path / "part.jsonl", tmp_path / "store", server.url, shared,
                                       vllm_model_dir, LAYERS, "--verifier", str(vllm_model_dir)))  # fmt: skip
    assert r.returncode == 0 and summary["stored"] == 10, r.stderr[-3000:]
    cmd = _train_cmd(server.url, tmp_path / "p.jsonl", vllm_model_dir, tmp_path, shared, "--epochs", "1")
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env())
    assert r.returncode == 0, r.stderr[-3000:]
    assert sorted(consumed_ids(tmp_path / "save")[0]) == sorted(ids)
    data = last_data_metrics(tmp_path / "save")
    assert data["samples_failed"] == 0
    assert data["samples_from_cache"] == 10 and data["samples_generated"] == 14, data
    assert os.listdir(shared) == []
    assert_alive(server)


def test_generate_argmax_targets_are_the_verifiers_own_argmax(vllm_extract, vllm_model_dir, sample_chats_path,
                                                              tmp_path):  # fmt: skip
    """``--targets argmax`` against the real vLLM: vLLM's ``prompt_logprobs`` (and its greedy token for
    the last position) as stored are transformers' own argmax of the verifier on the same token ids."""
    import torch
    from transformers import AutoModelForCausalLM

    server, shared = vllm_extract
    data = tmp_path / "chats.jsonl"
    n = 16
    write_chats(sample_chats_path, data, n, start=300)  # chats no other test of this module stores
    store = tmp_path / "argmax"
    r, summary = run_json(generate_cmd(data, store, server.url, shared, vllm_model_dir, LAYERS,
                                       "--targets", "argmax"))  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    assert summary["stored"] == n and summary["failed"] == 0, summary
    st = HiddenStateStore.open(store)
    assert st.header.targets == "argmax" and list(st.header.layer_ids) == LAYERS and st.verify() == []
    assert os.listdir(shared) == []

    model = AutoModelForCausalLM.from_pretrained(
        vllm_model_dir, dtype=torch.float32, local_files_only=True
    ).eval()
    positions, ties = 0, 0
    for sid in st.sample_ids():
        s = st.read(sid)
        assert s.target_ids is not None and s.target_ids.dtype == np.int32
        assert len(s.target_ids) == len(s.token_ids)
        with torch.no_grad():
            logits = model(torch.tensor(s.token_ids, dtype=torch.long)[None]).logits[0]
        want = logits.argmax(-1).numpy()
        for t in np.flatnonzero(s.target_ids != want):  # only an fp32 near-tie may differ
            gap = float(logits[t, want[t]] - logits[t, int(s.target_ids[t])])
            assert gap <= 1e-4 * float(logits[t].abs().max()), (
                sid,
                int(t),
                int(s.target_ids[t]),
                int(want[t]),
                gap,
            )
            ties += 1
        positions += len(want)
    assert positions > 0 and ties <= positions // 100, f"{ties} near-ties in {positions} positions"
    assert_alive(server)
