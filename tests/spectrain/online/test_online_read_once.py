"""OnlineSource read-once mode: fetched states land in the batch straight from the server's file, never in scratch."""

from __future__ import annotations

import json

import _online_support
import numpy as np
import pytest
from _online_support import (
    LAYERS,
    N_PROMPTS,
    check_sample,
    make_config,
    resume_after_losing_steps,
)

from hsgen.client.hidden_file import FileRows
from hsgen.store import HiddenStateStore
from spectrain.online import OnlineConfig, OnlineSource

# The module-scoped fixtures (one reference server per test module):
server, prompts_file, rendered = (
    _online_support.server,
    _online_support.prompts_file,
    _online_support.rendered,
)


def _batches(src: OnlineSource, epoch: int, seq: int = 256):
    """Train-like loop through the loader: yields each batch, then reports its samples consumed."""
    import torch

    from spectrain.data.sources import PackedLoader

    loader = PackedLoader(src, src.plan(epoch), total_seq_len=seq, layers=None, hidden_dtype=torch.float32)
    for b in loader:
        yield b
        src.consumed(b.sample_ids)
    return loader


def test_read_once_lands_in_the_batch_and_never_in_scratch(
    server, prompts_file, tiny_model_dir, tmp_path, rendered
):
    import torch

    cfg = make_config(
        server, prompts_file, tiny_model_dir, tmp_path, delete_consumed=True, scratch_bytes=3 << 20
    )  # read once: the default with --delete-consumed
    with OnlineSource(cfg) as src:
        for epoch in (0, 1):
            seen = []
            for b in _batches(src, epoch):
                first = b.sample_ids[0]
                held = src.get(first)  # the same mapping the batch was read from, still held
                n = min(len(held.token_ids), 256)
                assert torch.equal(b.hidden_states[:n], torch.from_numpy(np.array(held.hidden_states[:n])))
                off = 0
                for sid in b.sample_ids:
                    ids = rendered[0][sid].token_ids[:256]
                    assert b.input_ids[off : off + len(ids)].tolist() == ids
                    off += len(ids)
                seen += b.sample_ids
            assert sorted(seen) == sorted(rendered[0])
            with src.ledger.lock:
                assert not src.ledger.held  # released once their step completed
        stats = src.stats()
        scratch = HiddenStateStore.open(src.scratch_path)
        assert len(scratch) == 0 and scratch.shards() == {}  # nothing was written
    assert stats["samples_generated"] == 2 * N_PROMPTS and stats["samples_failed"] == 0


def test_read_once_refuses_non_finite_states_as_they_are_copied(
    server, prompts_file, tiny_model_dir, tmp_path, rendered
):
    import torch

    server.set_faults("nan=1.0:2")
    try:
        cfg = make_config(
            server, prompts_file, tiny_model_dir, tmp_path, delete_consumed=True, persist_fetched=False
        )
        with OnlineSource(cfg) as src:
            trained = 0
            for b in _batches(src, 0):
                assert torch.isfinite(b.hidden_states).all()
                trained += int((b.doc_ids >= 0).sum())
            stats = src.stats()
            failures = [json.loads(x) for x in src.failures_path.read_text().splitlines()]
    finally:
        server.set_faults(None)
    assert stats["samples_failed"] == 2 and len(failures) == 2
    assert all("NaN" in rec["reason"] for rec in failures)
    total = sum(min(len(p.token_ids), 256) for p in rendered[0].values())
    assert 0 < trained < total


def test_read_once_needs_delete_consumed():
    with pytest.raises(ValueError, match="persist_fetched"):
        OnlineConfig(["http://x"], ["p"], "s", "v", persist_fetched=False).validate()


def test_read_once_is_the_default_where_nothing_is_kept():
    def mode(**kw):
        cfg = OnlineConfig(["http://x"], ["p"], "s", "v", **kw)
        cfg.validate()
        return cfg.reads_once

    assert mode(delete_consumed=True)  # samples are deleted after their step anyway
    assert not mode()  # later epochs read what was fetched
    assert not mode(cache_generated=True)  # kept in the user's store
    assert not mode(delete_consumed=True, persist_fetched=True)  # asked for explicitly


def test_read_once_holds_the_bound_and_trains_each_sample_once_per_epoch(
    server, prompts_file, tiny_model_dir, tmp_path, rendered
):
    bound = 3 << 20
    cfg = make_config(
        server, prompts_file, tiny_model_dir, tmp_path, scratch_bytes=bound, delete_consumed=True
    )
    sizes = []
    with OnlineSource(cfg) as src:
        assert src.config.reads_once
        assert src.header.num_layers == len(
            LAYERS
        )  # as the trainer does: the probe fetches the first sample,
        src.plan(1)  # then every epoch is planned to size the LR schedule
        for epoch in (0, 1):
            plan = src.plan(epoch)
            for i in range(0, len(plan), 3):
                ids = plan[i : i + 3]
                for sid in ids:
                    check_sample(src.get(sid), rendered[0][sid])
                with src.ledger.lock:
                    sizes.append(src.ledger.in_use())
                    rows = [src.ledger.held[sid][0].hidden_states for sid in ids if sid in src.ledger.held]
                assert rows and all(isinstance(r, FileRows) for r in rows)  # left in the server's file
                src.consumed(ids)
                assert all(r._file.fd < 0 for r in rows)  # its pages released with the step
        stats = src.stats()
        scratch = HiddenStateStore.open(src.scratch_path)
        assert len(scratch) == 0  # nothing committed
    assert max(sizes) <= bound and 0 < stats["held_peak_bytes"] <= bound
    assert stats["held_bytes"] == 0  # every held sample released after its step
    assert stats["samples_generated"] == 2 * N_PROMPTS and stats["overshoots"] == 0
    log = [
        json.loads(x) for x in (tmp_path / "save" / "online-consumed-rank0.jsonl").read_text().splitlines()
    ]
    for epoch in (0, 1):
        assert sorted(i for rec in log if rec["epoch"] == epoch for i in rec["ids"]) == sorted(rendered[0])


def test_read_once_resume_fetches_again_what_was_fetched_but_not_trained(
    server, prompts_file, tiny_model_dir, tmp_path, rendered
):
    cfg = make_config(server, prompts_file, tiny_model_dir, tmp_path, delete_consumed=True)
    plan, stats = resume_after_losing_steps(cfg, rendered)
    assert stats["samples_generated"] == len(plan) - 6 and stats["samples_from_scratch"] == 0
