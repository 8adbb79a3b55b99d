"""Shared set-up of the OnlineSource tests: the reference server, the prompts, and drivers acting as the trainer."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import numpy as np
import pytest

from hsgen.client.config import ClientConfig
from hsgen.generate.pipeline import GenerateConfig, generate
from hsgen.inputs.formats import read_inputs
from hsgen.inputs.render import ChatRenderer, RenderConfig
from hsgen.serve.testing import running_server
from hsgen.store import HiddenStateStore, StoreHeader
from spectrain.online import OnlineConfig, OnlineSource, dir_bytes

LAYERS = [1, 2, 4]
N_PROMPTS = 24


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    with running_server(tiny_model_dir, LAYERS, tmp_path_factory.mktemp("hs"), dtype="float32") as url:
        yield url


@pytest.fixture(scope="module")
def prompts_file(sample_chats_path, tmp_path_factory) -> Path:
    lines = Path(sample_chats_path).read_text().splitlines()[:N_PROMPTS]
    p = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    p.write_text("\n".join(lines) + "\n")
    return p


@pytest.fixture(scope="module")
def rendered(prompts_file, tiny_model_dir):
    r = ChatRenderer(RenderConfig(tokenizer_path=str(tiny_model_dir)))
    return {s.sample_id: r.render(s) for s in read_inputs([prompts_file])}, r.fingerprint


def make_config(server, prompts_file, tiny_model_dir, tmp_path, **kw) -> OnlineConfig:
    base = dict(
        endpoints=[server],
        prompts=[str(prompts_file)],
        store=str(tmp_path / "store"),
        verifier=str(tiny_model_dir),
        save_path=str(tmp_path / "save"),
        layer_ids=LAYERS,
        scratch_dir=str(tmp_path / "scratch"),
        shared_dir=str(server.shared_dir),
        client_options={"max_retries": 0},
    )
    base.update(kw)
    return OnlineConfig(**base)


def drive(src: OnlineSource, epoch: int, batch: int = 3, start: int = 0, stop: int | None = None):
    """Act like the trainer: read a batch, 'step', then report it consumed. Returns samples and peak scratch."""
    plan = src.plan(epoch)
    got = {}
    peak = 0
    end = len(plan) if stop is None else stop
    for i in range(start, end, batch):
        ids = plan[i : min(i + batch, end)]
        for sid in ids:
            got[sid] = src.get(sid)
        if src.scratch_path is not None:
            peak = max(peak, dir_bytes(src.scratch_path))
        src.consumed(ids)
    return plan, got, peak


def check_sample(sample, prompt, dtype="float32"):
    assert sample is not None
    assert sample.token_ids.tolist() == prompt.token_ids
    assert sample.loss_mask.tolist() == prompt.loss_mask
    assert sample.hidden_states.shape == (len(prompt.token_ids), len(LAYERS), 64)
    assert sample.dtype == dtype
    assert np.isfinite(sample.hidden_states).all()


def prefill(server, tmp_path, rendered, ids, shard_bytes: int = 32 << 20) -> HiddenStateStore:
    prompts, fingerprint = rendered
    header = StoreHeader(
        verifier="tiny",
        layer_ids=tuple(LAYERS),
        hidden_size=64,
        dtype="float32",
        tokenizer_fingerprint=fingerprint,
    )
    store = HiddenStateStore.create(tmp_path / "store", header)
    cfg = GenerateConfig(
        client=ClientConfig(endpoints=[server], shared_dir=str(server.shared_dir)), shard_bytes=shard_bytes
    )
    summary = asyncio.run(generate(cfg, [prompts[i] for i in ids], store, progress=False))
    assert summary.stored == len(ids)
    store.refresh()
    return store


def resume_after_losing_steps(cfg, rendered) -> tuple[list[str], dict]:
    """Train positions 0..11 of epoch 0, let the whole window ahead land, close (as a crash after
    the checkpoint at position 6 would: steps 6..11 are lost), resume from 6 and check every
    sample read then. Returns the plan and the resumed source's stats."""
    src = OnlineSource(cfg)
    plan, _, _ = drive(src, 0, stop=12)
    deadline = time.monotonic() + 600
    while src.stats()["samples_generated"] < len(plan) and time.monotonic() < deadline:
        time.sleep(0.05)  # the trainer can outrun the fetcher: let the window ahead land first
    assert src.stats()["samples_generated"] == len(plan)
    src.close()
    resumed = OnlineSource(cfg)
    try:
        _, got, _ = drive(resumed, 0, start=6)
        stats = resumed.stats()
    finally:
        resumed.close()
    assert sorted(got) == sorted(plan[6:])
    for sid, sample in got.items():
        check_sample(sample, rendered[0][sid])
    return plan, stats
