"""Host-side collectives go over the gloo control group, never NCCL (which a CPU machine cannot run)."""

from __future__ import annotations

import torch.distributed as dist

from spectrain.distributed import DistInfo, gather


def test_gather_uses_the_control_group(monkeypatch):
    control = object()  # the gloo group init_distributed makes beside an NCCL default group
    seen = {}

    def all_gather_object(out, obj, group=None):
        seen["group"] = group
        out[:] = [obj] * len(out)

    monkeypatch.setattr(dist, "all_gather_object", all_gather_object)
    assert gather({"position": 3}, DistInfo(rank=0, world_size=2, control=control)) == [{"position": 3}] * 2
    assert seen["group"] is control
    assert gather(7, DistInfo()) == [7]  # one process: no collective
