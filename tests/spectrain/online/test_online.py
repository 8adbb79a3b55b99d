"""OnlineSource against the reference server: online, mixed, cached, failures, resume, ranks."""

from __future__ import annotations

import json
import shutil
import time

import _online_support
import numpy as np
import pytest
from _online_support import (
    LAYERS,
    N_PROMPTS,
    check_sample,
    drive,
    make_config,
    prefill,
    resume_after_losing_steps,
)

from hsgen.serve.testing import running_server
from hsgen.store import HiddenStateStore, StoreHeader
from spectrain.online import OnlineConfig, OnlineSource, choose_scratch_dir
from spectrain.online.scratch import scratch_dirs

# The module-scoped fixtures (one reference server per test module):
server, prompts_file, rendered = (
    _online_support.server,
    _online_support.prompts_file,
    _online_support.rendered,
)


def test_online_delete_consumed_keeps_scratch_bounded(
    server, prompts_file, tiny_model_dir, tmp_path, rendered
):
    bound = 3 << 20
    cfg = make_config(
        server, prompts_file, tiny_model_dir, tmp_path, scratch_bytes=bound, delete_consumed=True,
        persist_fetched=True,
    )  # fmt: skip
    src = OnlineSource(cfg)
    try:
        for epoch in (0, 1):
            plan, got, peak = drive(src, epoch)
            assert sorted(plan) == sorted(rendered[0])
            assert len(got) == len(plan)
            for sid, sample in got.items():
                check_sample(sample, rendered[0][sid])
            assert peak <= bound
        stats = src.stats()
        # everything epoch 0 consumed is deleted at the boundary and fetched again in epoch 1
        assert stats["samples_generated"] == 2 * N_PROMPTS
        assert stats["samples_from_scratch"] == 0
        assert stats["samples_failed"] == 0 and stats["overshoots"] == 0
        assert stats["scratch_peak_bytes"] <= bound
        assert stats["shards_deleted"] > 0
    finally:
        src.close()
    assert not (tmp_path / "scratch").exists()
    log = [
        json.loads(x) for x in (tmp_path / "save" / "online-consumed-rank0.jsonl").read_text().splitlines()
    ]
    for epoch in (0, 1):
        ids = [i for rec in log if rec["epoch"] == epoch for i in rec["ids"]]
        assert sorted(ids) == sorted(rendered[0])


def test_consumed_shards_survive_until_consumed(server, prompts_file, tiny_model_dir, tmp_path, rendered):
    cfg = make_config(
        server, prompts_file, tiny_model_dir, tmp_path, delete_consumed=True, persist_fetched=True
    )
    with OnlineSource(cfg) as src:
        plan = src.plan(0)
        for sid in plan[:6]:
            assert src.get(sid) is not None
        scratch = HiddenStateStore.open(src.scratch_path)
        assert all(sid in scratch for sid in plan[:6])  # read, not consumed: still there
        src.consumed(plan[:6])
        for sid in plan[6:]:
            src.get(sid)
        src.consumed(plan[6:])
        deadline = 50
        while deadline and (scratch.refresh() or len(scratch)):
            time.sleep(0.1)
            deadline -= 1
        assert len(scratch) == 0


def test_epoch_boundary_deletes_what_the_last_epoch_consumed(
    server, prompts_file, tiny_model_dir, tmp_path, rendered
):
    cfg = make_config(
        server, prompts_file, tiny_model_dir, tmp_path, delete_consumed=True, persist_fetched=True
    )
    with OnlineSource(cfg) as src:
        drive(src, 0, batch=4)
        # no get() of epoch 1 yet: plan(1) alone must have finished epoch 0's deletions, so
        # that nothing epoch 1 counts on can vanish later and nothing consumed lingers
        src.plan(1)
        scratch = HiddenStateStore.open(src.scratch_path)
        assert len(scratch) == 0 and scratch.shards() == {}
        plan, got, _ = drive(src, 1, batch=4)
        assert all(got[sid] is not None for sid in plan)
        assert src.stats()["samples_generated"] == 2 * N_PROMPTS


def test_scratch_shards_stay_near_their_size_when_fetches_land_together(
    server, prompts_file, tiny_model_dir, tmp_path, rendered
):
    from spectrain.online.scratch import PER_SAMPLE_OVERHEAD

    prompts = rendered[0]
    est = {
        sid: len(p.token_ids) * (len(LAYERS) * 64 * 4 + 9) + PER_SAMPLE_OVERHEAD for sid, p in prompts.items()
    }
    shard_bytes = 2 * int(np.median(list(est.values())))
    cfg = make_config(server, prompts_file, tiny_model_dir, tmp_path, shard_bytes=shard_bytes)
    with OnlineSource(cfg) as src:
        plan = src.plan(0)
        src.get(plan[0])  # every prompt is requested at once: many fetches finish together
        for sid in plan:
            assert src.get(sid) is not None
        shards = HiddenStateStore.open(src.scratch_path).shards()
        assert sum(len(ids) for ids in shards.values()) == N_PROMPTS
        for ids in shards.values():
            sizes = [est[i] for i in ids]
            assert sum(sizes) - max(sizes) < shard_bytes, f"a shard of {len(ids)} samples"
        src.consumed(plan)


def test_mixed_reads_cache_and_never_deletes_it(server, prompts_file, tiny_model_dir, tmp_path, rendered):
    ids = sorted(rendered[0])[::2]
    store = prefill(server, tmp_path, rendered, ids)
    shards_before = store.shards()
    cfg = make_config(server, prompts_file, tiny_model_dir, tmp_path, delete_consumed=True)
    with OnlineSource(cfg) as src:
        plan, got, _ = drive(src, 0)
        for sid, sample in got.items():
            check_sample(sample, rendered[0][sid])
        stats = src.stats()
    assert stats["samples_from_cache"] == len(ids)
    assert stats["samples_generated"] == N_PROMPTS - len(ids)
    store.refresh()
    assert store.shards() == shards_before
    assert all((tmp_path / "store" / s).exists() for s in shards_before)


def test_delete_cached_is_explicit_and_after_consumption(
    server, prompts_file, tiny_model_dir, tmp_path, rendered
):
    ids = sorted(rendered[0])
    store = prefill(server, tmp_path, rendered, ids)
    cfg = make_config(server, prompts_file, tiny_model_dir, tmp_path, delete_cached=True)
    with OnlineSource(cfg) as src:
        plan = src.plan(0)
        for sid in plan:
            assert src.get(sid) is not None
        store.refresh()
        assert len(store) == N_PROMPTS  # read but not consumed
        src.consumed(plan)
        for _ in range(50):
            store.refresh()
            if len(store) == 0:
                break
            time.sleep(0.1)
        assert len(store) == 0
        assert src.stats()["samples_generated"] == 0


def test_skipped_tail_frees_scratch_but_never_the_cache(
    server, prompts_file, tiny_model_dir, tmp_path, rendered
):
    cached = sorted(rendered[0])[::2]
    store = prefill(server, tmp_path, rendered, cached, shard_bytes=150 << 10)  # 1-2 samples a shard
    shards_before = len(store.shards())
    cfg = make_config(
        server, prompts_file, tiny_model_dir, tmp_path, delete_consumed=True, delete_cached=True
    )
    with OnlineSource(cfg) as src:
        plan = src.plan(0)
        for sid in plan:
            assert src.get(sid) is not None
        src.consumed(plan[:-6])
        src.skipped(plan[-6:])  # as the trainer reports a rank's untrained tail
        src.plan(1)  # waits for epoch 0's deletions
        scratch = HiddenStateStore.open(src.scratch_path)
        assert len(scratch) == 0  # every generated sample was consumed or skipped
        store.refresh()
        tail = set(plan[-6:])
        assert set(cached) & tail and set(cached) & tail <= set(store.sample_ids())  # skipped: kept
        assert all(set(ids) & tail for ids in store.shards().values())  # the rest went when consumed
        assert len(store.shards()) < shards_before
        assert src.stats()["samples_skipped"] == 6


def test_cache_generated_later_epochs_read(server, prompts_file, tiny_model_dir, tmp_path, rendered):
    cfg = make_config(server, prompts_file, tiny_model_dir, tmp_path, cache_generated=True)
    with OnlineSource(cfg) as src:
        drive(src, 0)
        first = src.stats()
        _, got, _ = drive(src, 1)
        second = src.stats()
    assert first["samples_generated"] == N_PROMPTS and first["samples_from_cache"] == 0
    assert second["samples_generated"] == N_PROMPTS and second["samples_from_cache"] == N_PROMPTS
    store = HiddenStateStore.open(tmp_path / "store")
    assert sorted(store.sample_ids()) == sorted(rendered[0])
    assert store.verify() == []
    for sid, sample in got.items():
        check_sample(sample, rendered[0][sid])


def test_failed_samples_are_reported_and_skipped(server, prompts_file, tiny_model_dir, tmp_path, rendered):
    server.set_faults("token_mismatch=1.0:2")
    try:
        cfg = make_config(server, prompts_file, tiny_model_dir, tmp_path, delete_consumed=True)
        with OnlineSource(cfg) as src:
            plan, got, _ = drive(src, 0)
            stats = src.stats()
            failures_path = src.failures_path
    finally:
        server.set_faults(None)
    failed = [sid for sid, s in got.items() if s is None]
    assert len(failed) == 2 and stats["samples_failed"] == 2
    lines = [json.loads(x) for x in failures_path.read_text().splitlines()]
    assert sorted(rec["sample_id"] for rec in lines) == sorted(failed)
    assert all("token" in rec["reason"] for rec in lines)
    assert len(got) == len(plan)


def test_resume_refetches_deleted_and_reads_prefetched(
    server, prompts_file, tiny_model_dir, tmp_path, rendered
):
    cfg = make_config(
        server, prompts_file, tiny_model_dir, tmp_path, delete_consumed=True, persist_fetched=True
    )
    plan, stats = resume_after_losing_steps(cfg, rendered)
    assert stats["samples_generated"] + stats["samples_from_scratch"] == len(plan) - 6
    assert stats["samples_generated"] < len(plan) - 6  # what was prefetched beyond 12 is read, not refetched


def test_resumed_header_probe_fetches_a_sample_the_run_trains(
    server, prompts_file, tiny_model_dir, tmp_path, rendered
):
    """A run resumed in epoch 1 on a new store learns the header from a sample it trains next,
    not from epoch 0's first (fetched, then never trained): each sample is requested once."""
    cfg = make_config(server, prompts_file, tiny_model_dir, tmp_path, delete_consumed=True)
    src = OnlineSource(cfg)
    try:
        plan0, plan1 = src._plan_fn(src.split_ids, 0), src._plan_fn(src.split_ids, 1)
        position = plan1.index(plan0[0]) + 1  # epoch 0's first sample is behind the resumed cursor
        src.resume_at(1, position)
        assert src.header.hidden_size > 0
        _, got, _ = drive(src, 1, start=position)
        stats = src.stats()
    finally:
        src.close()
    assert sorted(got) == sorted(plan1[position:])
    assert stats["samples_generated"] == len(plan1) - position


def test_ranks_fetch_only_their_share(server, prompts_file, tiny_model_dir, tmp_path, rendered):
    sources = [
        OnlineSource(
            make_config(
                server,
                prompts_file,
                tiny_model_dir,
                tmp_path / f"r{r}",
                rank=r,
                world_size=2,
                delete_consumed=True,
            )
        )
        for r in (0, 1)
    ]
    try:
        plans = []
        for src in sources:
            plan, got, _ = drive(src, 0)
            plans.append(plan)
            assert all(s is not None for s in got.values())
            assert src.stats()["samples_generated"] == len(plan)
    finally:
        for src in sources:
            src.close()
    assert not set(plans[0]) & set(plans[1])
    assert sorted(plans[0] + plans[1]) == sorted(rendered[0])


def test_header_mismatch_is_a_clear_error(server, prompts_file, tiny_model_dir, tmp_path, rendered):
    header = StoreHeader(verifier="tiny", layer_ids=(1, 2), hidden_size=64, dtype="float32")
    HiddenStateStore.create(tmp_path / "store", header)
    cfg = make_config(server, prompts_file, tiny_model_dir, tmp_path)
    with OnlineSource(cfg) as src:
        plan = src.plan(0)
        with pytest.raises(RuntimeError, match=r"sends 3 layers, the store holds 2 \(.*store\)"):
            src.get(plan[0])


def test_a_new_store_never_adopts_a_hidden_size_the_model_does_not_have(
    server, prompts_file, tiny_model_dir, tmp_path
):
    """The server's files are checked on their header against the verifier's config (issue 21, hole 3)."""
    verifier = tmp_path / "verifier"
    shutil.copytree(tiny_model_dir, verifier)
    config = json.loads((verifier / "config.json").read_text())
    (verifier / "config.json").write_text(json.dumps({**config, "hidden_size": 32}))
    cfg = make_config(server, prompts_file, verifier, tmp_path, cache_generated=True)
    with OnlineSource(cfg) as src, pytest.raises(RuntimeError, match="hidden size 64, the model's is 32"):
        src.get(src.plan(0)[0])
    assert not (tmp_path / "store").exists()


def test_a_failed_run_prints_no_figure_it_does_not_know(
    server, prompts_file, tiny_model_dir, tmp_path, caplog
):
    """Issue 33: removing a failed run's scratch logged '/dev/shm has 25.28 GB free, 4611686018.43 GB
    needed' (a made-up need, to find where a scratch store might be) before any header was known."""
    verifier = tmp_path / "verifier"
    shutil.copytree(tiny_model_dir, verifier)
    config = json.loads((verifier / "config.json").read_text())
    (verifier / "config.json").write_text(json.dumps({**config, "hidden_size": 32}))
    cfg = make_config(server, prompts_file, verifier, tmp_path, scratch_dir=None)
    caplog.set_level("INFO")
    with OnlineSource(cfg) as src:
        with pytest.raises(RuntimeError, match="hidden size 64, the model's is 32"):
            src.get(src.plan(0)[0])
        src.discard_scratch()
    said = [r.getMessage() for r in caplog.records if " GB" in r.getMessage()]
    assert not [m for m in said if "4611686018" in m or "needed" in m], said


def test_choose_scratch_dir_falls_back_when_tmpfs_is_small(tmp_path):
    shm = tmp_path / "shm"
    shm.mkdir()
    small = choose_scratch_dir(str(tmp_path / "save"), 1, 1 << 20, shm=str(shm))
    assert small.parent == shm and small.name.endswith("rank1")
    assert choose_scratch_dir(str(tmp_path / "save"), 1, 1 << 20, shm=str(shm)) == small  # stable for resume
    huge = choose_scratch_dir(str(tmp_path / "save"), 1, 1 << 60, shm=str(shm))
    assert huge == tmp_path / "save" / "online-scratch-rank1"
    assert scratch_dirs(str(tmp_path / "save"), 1, shm=str(shm)) == (small, huge)


def test_config_from_train_config(tiny_model_dir, tmp_path):
    from spectrain.train.loop import TrainConfig

    tc = TrainConfig(
        verifier=str(tiny_model_dir),
        save_path=str(tmp_path),
        online=True,
        endpoints=["http://x:8000"],
        prompts="p.jsonl",
        delete_consumed=True,
        online_options={"scratch_bytes": 1 << 24, "shared_dir": "/dev/shm/hs"},
    )
    cfg = OnlineConfig.from_train_config(tc, rank=1, world_size=2)
    assert cfg.scratch_bytes == 1 << 24 and cfg.shared_dir == "/dev/shm/hs"
    assert cfg.rank == 1 and cfg.world_size == 2 and cfg.delete_consumed
    assert cfg.layer_ids == [1, 4]  # DFlash default for the tiny model's 4 layers
    tc.online_options = {"scratch_byte": 1}
    with pytest.raises(ValueError, match="scratch_byte"):
        OnlineConfig.from_train_config(tc)
    with pytest.raises(ValueError, match="contradict"):
        OnlineConfig(["http://x"], ["p"], "s", "v", delete_consumed=True, cache_generated=True).validate()


def test_node_local_endpoints_from_the_launcher(tiny_model_dir, tmp_path, monkeypatch):
    from spectrain.train.loop import TrainConfig

    monkeypatch.setenv("LOCAL_RANK", "1")
    tc = TrainConfig(
        verifier=str(tiny_model_dir),
        save_path=str(tmp_path),
        online=True,
        endpoints=["http://localhost:{8000+local_rank}", "http://node{rank}:9000"],
        prompts="p.jsonl",
    )
    cfg = OnlineConfig.from_train_config(tc, rank=3, world_size=4)
    assert cfg.endpoints == ["http://localhost:8001", "http://node3:9000"]
    tc.endpoints = ["http://a:1", "http://b:2", "http://c:3"]
    tc.online_options = {"endpoint_per_local_rank": True}
    assert OnlineConfig.from_train_config(tc, rank=3, world_size=4).endpoints == ["http://b:2"]


def test_fatal_client_error_stops_with_a_clear_message(tiny_model_dir, prompts_file, tmp_path):
    with running_server(tiny_model_dir, LAYERS, tmp_path / "hs", api_key="secret", dtype="float32") as url:
        cfg = make_config(url, prompts_file, tiny_model_dir, tmp_path, api_key="wrong")
        with OnlineSource(cfg) as src, pytest.raises(RuntimeError, match="unauthorized"):
            _ = src.header  # the probe fetch is refused: every other request would be too


def test_validation_source_fetches_its_split_and_cleans_up(
    server, prompts_file, tiny_model_dir, tmp_path, rendered
):
    cfg = make_config(
        server, prompts_file, tiny_model_dir, tmp_path, validation_fraction=0.3, delete_consumed=True
    )
    with OnlineSource(cfg) as src:
        val = src.validation_source()
        assert val is not None
        try:
            plan = val.plan(0)
            assert plan and set(plan) == set(src.validation_ids)
            assert not set(plan) & set(src.plan(0))
            for sid in plan:
                check_sample(val.get(sid), rendered[0][sid])
            scratch = val.scratch_path
            assert scratch is not None and scratch.exists()
        finally:
            val.close()
        assert not scratch.exists()


def test_cache_generated_with_validation_writes_both_splits(
    server, prompts_file, tiny_model_dir, tmp_path, rendered
):
    """The training and validation sources cache into one store at once: each writes with its own
    writer id (issue 21, hole 1: both used ``online-rank{r}-{pid}`` and the second was refused)."""
    cfg = make_config(
        server, prompts_file, tiny_model_dir, tmp_path, validation_fraction=0.3, cache_generated=True
    )
    with OnlineSource(cfg) as src:
        drive(src, 0)
        val = src.validation_source()
        assert val is not None
        try:
            for sid in val.plan(0):
                check_sample(val.get(sid), rendered[0][sid])
        finally:
            val.close()
    store = HiddenStateStore.open(tmp_path / "store")
    assert sorted(store.sample_ids()) == sorted(rendered[0])
    assert store.verify() == []
