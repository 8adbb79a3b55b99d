"""Muon's Newton-Schulz work split over data-parallel ranks (spectrain.train.muon): the same weights
as the unsplit run, each rank orthogonalising only its share, and a resumable optimizer state."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from spectrain.train.muon import assign_owners, ns_flops, rank_loads

sys.path.insert(0, str(Path(__file__).parents[1]))
from _muon_worker import STEPS  # noqa: E402


def test_owners_balance_the_flops_and_agree_everywhere():
    shapes = [(4096, 4096), (1024, 4096), (1024, 4096), (4096, 4096), (12288, 4096), (12288, 4096),
              (4096, 12288)] * 5 + [(4096, 12288)]  # fmt: skip
    total = sum(ns_flops(s, 5) for s in shapes)
    assert assign_owners(shapes, 1) == [0] * len(shapes)
    for world in (2, 8):
        owners = assign_owners(shapes, world)
        assert owners == assign_owners(list(shapes), world)  # a function of the shapes alone
        assert set(owners) == set(range(world))
        loads = rank_loads(shapes, world)
        assert sum(loads) == total
        assert max(loads) <= total / world + max(ns_flops(s, 5) for s in shapes)
    assert max(rank_loads(shapes, 8)) < 0.14 * total  # near an eighth, not the whole


def test_two_ranks_split_equals_unsplit_and_resumes(tmp_path):
    """Two gloo ranks under DDP train a tiny DFlash for 3 steps with Muon unsplit and split: the
    weights are bitwise equal (tolerance 0: each update's bytes are its owner's), each rank made
    only its share of the Newton-Schulz calls, and a split run resumed from the step-2 state
    (the unsplit format) ends where the continuous one does."""
    import torch.multiprocessing as mp
    from _muon_worker import muon_rank

    mp.spawn(muon_rank, args=(2, str(tmp_path / "store"), str(tmp_path)), nprocs=2, join=True)
    r = [torch.load(tmp_path / f"muon{k}.pt", weights_only=False) for k in (0, 1)]
    n = len(r[0]["matrices"])
    owners = assign_owners(r[0]["matrices"], 2)
    for k in (0, 1):
        assert r[k]["unsplit_calls"] == n * STEPS
        assert r[k]["split_calls"] == owners.count(k) * STEPS
        assert 0 < r[k]["split_calls"] < n * STEPS
        assert r[k]["split_flops"] == rank_loads(r[0]["matrices"], 2)[k] < r[k]["unsplit_flops"]
        for name, w in r[k]["unsplit_weights"].items():
            assert torch.equal(r[k]["split_weights"][name], w), name
            assert torch.equal(r[k]["resumed_weights"][name], w), name
            assert torch.equal(r[1 - k]["split_weights"][name], w), name  # the ranks agree
        # the saved optimizer state is the unsplit one: same keys, same momentum, same counters
        a, b = r[k]["split_state2"], r[k]["unsplit_state2"]
        assert len(a) == len(b)
        for sa, sb in zip(a, b, strict=True):
            assert sa["param_groups"] == sb["param_groups"] and sa["state"].keys() == sb["state"].keys()
            for i in sa["state"]:
                for key, v in sa["state"][i].items():
                    assert torch.equal(v, sb["state"][i][key]), (i, key)
    assert r[0]["split_calls"] + r[1]["split_calls"] == n * STEPS
    assert r[0]["split_flops"] + r[1]["split_flops"] == r[0]["unsplit_flops"]


def test_the_split_is_refused_in_one_line_for_fsdp_shards(tmp_path):
    """FSDP's parameters are shards (DTensors): the split, which needs whole matrices, is refused."""
    import pytest
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from spectrain.train.optim import MuonSplit, OptimConfig, build_optimizers

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 8))
        fully_shard(model)
        cfg = OptimConfig(optimizer="muon")
        with pytest.raises(ValueError, match=r"^muon: the Newton-Schulz split .* sharded \(FSDP\)[^\n]*$"):
            build_optimizers(model, cfg, lambda s: 1.0, split=MuonSplit(0, 2))
        build_optimizers(model, cfg, lambda s: 1.0)  # unsplit, as the trainer builds it under FSDP
    finally:
        dist.destroy_process_group()
