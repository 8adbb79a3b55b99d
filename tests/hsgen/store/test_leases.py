"""Leases: one live generator per rank of a store; a dead client's server files are swept
(issue 13, point 10; issue 14, point 3)."""

from __future__ import annotations

import os
import time

import pytest

from hsgen.store.leases import LeaseConflict, acquire_lease, read_leases, sweep_dead_leases


def test_leases_refuse_the_same_rank_and_another_world_size(tmp_path):
    a = acquire_lease(tmp_path / "st", world_size=2, rank=0, request_prefix="hsgen-aaaaaaaaaaaa-")
    with pytest.raises(LeaseConflict, match="already being filled by rank 0"):
        acquire_lease(tmp_path / "st", world_size=2, rank=0, request_prefix="hsgen-bbbbbbbbbbbb-")
    with pytest.raises(LeaseConflict, match="--world-size 2"):
        acquire_lease(tmp_path / "st", world_size=1, rank=0, request_prefix="hsgen-bbbbbbbbbbbb-")
    b = acquire_lease(tmp_path / "st", world_size=2, rank=1, request_prefix="hsgen-cccccccccccc-")
    assert sorted(lease.live for lease in read_leases(tmp_path / "st")) == [True, True]
    a.release()
    again = acquire_lease(tmp_path / "st", world_size=2, rank=0, request_prefix="hsgen-dddddddddddd-")
    again.release()
    b.release()


def test_sweep_removes_only_dead_clients_files(tmp_path):
    shared = tmp_path / "shm"
    shared.mkdir()
    dead = acquire_lease(tmp_path / "st", world_size=1, rank=0, request_prefix="hsgen-deaddeaddead-")
    dead.release()
    live = acquire_lease(tmp_path / "st", world_size=1, rank=0, request_prefix="hsgen-11ee11ee11ee-")
    names = {
        "cmpl-hsgen-deaddeaddead-0123456789abcdef-0-aaaaaaaa.safetensors": False,
        "cmpl-hsgen-deaddeaddead-0123456789abcdef-0-aaaaaaaa.safetensors.lock": False,
        "cmpl-hsgen-11ee11ee11ee-0123456789abcdef-0-bbbbbbbb.safetensors": True,  # a live client's
        "cmpl-hsgen-0f0f0f0f0f0f-0123456789abcdef-0-cccccccc.safetensors": True,  # another store's client
        "cmpl-0123456789abcdef-0-dddddddd.safetensors": True,  # not hsgen's at all
    }
    for n in names:
        (shared / n).write_bytes(b"x")
    out = sweep_dead_leases(tmp_path / "st", [str(shared)], dry_run=True)
    assert out["orphans_removed"] == 2 and len(os.listdir(shared)) == 5
    out = sweep_dead_leases(tmp_path / "st", [str(shared)])
    assert out["orphans_removed"] == 2
    assert sorted(os.listdir(shared)) == sorted(n for n, keep in names.items() if keep)
    assert out["leases_removed"] == 0  # a dead lease is kept a while: late files may still come
    old = time.time() - 3600
    os.utime(dead.path, (old, old))
    assert sweep_dead_leases(tmp_path / "st", [str(shared)])["leases_removed"] == 1
    live.release()
