"""The server files of a killed online run are found by its request prefix, recorded in a lease."""

from __future__ import annotations

import subprocess
import sys

import pytest

from hsgen.store.leases import acquire_lease, read_leases
from spectrain.online import OnlineConfig
from spectrain.online.run_lease import RunLease


def _config(tmp_path, **kw) -> OnlineConfig:
    base = dict(endpoints=["http://x"], prompts=["p"], store=str(tmp_path / "store"), verifier="v",
                save_path=str(tmp_path / "save"), shared_dir=str(tmp_path / "shm"))  # fmt: skip
    base.update(kw)
    return OnlineConfig(**base)


def _file(prefix: str, n: int = 0) -> str:
    return f"cmpl-{prefix}t-{n:016x}-0-abcdef01.safetensors"


def test_a_resume_removes_the_dead_runs_files_and_nothing_else(tmp_path):
    shm = tmp_path / "shm"
    shm.mkdir()
    dead = acquire_lease(tmp_path / "save", world_size=2, rank=0, request_prefix="hsgen-dead00dead00-",
                         shared_dir=str(shm))  # fmt: skip
    dead.release()  # as a kill -9 frees the lock
    live = acquire_lease(tmp_path / "save", world_size=2, rank=1, request_prefix="hsgen-a11ve0a11ve0-",
                         shared_dir=str(shm))  # fmt: skip
    left = [
        _file("hsgen-dead00dead00-"),
        _file("hsgen-dead00dead00-") + ".lock",
        _file("hsgen-dead00dead00-", 1),
    ]
    kept = [
        _file("hsgen-a11ve0a11ve0-"),  # the live rank's request in flight
        _file("hsgen-0f0f0f0f0f0f-"),  # another client's
        "cmpl-0123456789abcdef-0-dddddddd.safetensors",  # a client without a prefix
    ]
    for name in left + kept:
        (shm / name).write_bytes(b"x")
    run = RunLease(_config(tmp_path, world_size=2, rank=0))
    try:
        assert sorted(p.name for p in shm.iterdir()) == sorted(kept)
        assert run.orphans_removed == 3
        mine = [i for i in read_leases(tmp_path / "save") if i.live and i.request_prefix == run.prefix]
        assert len(mine) == 1 and mine[0].shared_dir == str(shm) and mine[0].rank == 0
        assert run.client_prefix("train").startswith(run.prefix) and run.client_prefix(
            "train"
        ) != run.client_prefix("validation")
        (shm / _file(run.prefix)).write_bytes(b"x")  # its own request cancelled at the end
        (shm / _file("hsgen-dead00dead00-", 2)).write_bytes(b"x")  # the dead run's request finished late
    finally:
        run.close(run.client_prefix("train"))
        live.release()
    assert sorted(p.name for p in shm.iterdir()) == sorted(kept)
    assert not any(i.live for i in read_leases(tmp_path / "save"))


def test_a_live_run_of_the_same_rank_is_refused(tmp_path):
    (tmp_path / "shm").mkdir()
    first = RunLease(_config(tmp_path))
    try:
        with pytest.raises(RuntimeError, match="in use by another online run"):
            RunLease(_config(tmp_path))
    finally:
        first.close(None)
    RunLease(_config(tmp_path)).close(None)  # free again once the first one closed


def test_hsgen_gc_finds_a_dead_runs_files_in_the_save_path(tmp_path):
    shm = tmp_path / "shm"
    shm.mkdir()
    run = RunLease(_config(tmp_path))
    run.lease.release()  # died without closing
    (shm / _file(run.prefix)).write_bytes(b"x")
    (shm / _file("hsgen-0f0f0f0f0f0f-")).write_bytes(b"x")
    r = subprocess.run(
        [sys.executable, "-m", "hsgen.cli", "gc", str(tmp_path / "save"), "--shared-dir", str(shm), "--json"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert [p.name for p in shm.iterdir()] == [_file("hsgen-0f0f0f0f0f0f-")]


def test_no_save_path_takes_no_lease(tmp_path):
    (tmp_path / "shm").mkdir()
    run = RunLease(_config(tmp_path, save_path=None))
    assert run.lease is None and run.sweep() == 0
    (tmp_path / "shm" / _file(run.prefix)).write_bytes(b"x")
    run.close(run.client_prefix("train"))
    assert not any((tmp_path / "shm").iterdir())
