"""Entry point of one rank in the multi-process tests (spawned by torch.multiprocessing)."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path


def run_rank(rank: int, world: int, port: int, cfg_dict: dict, out_dir: str) -> None:
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(world),
                       "RANK": str(rank), "LOCAL_RANK": str(rank)})  # fmt: skip
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    from spectrain.train.loop import TrainConfig, Trainer

    trainer = Trainer(TrainConfig.from_dict(cfg_dict))
    plan = trainer.source.plan(0)
    summary = trainer.run()
    if cfg_dict.get("distributed") == "fsdp":
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        state = get_model_state_dict(trainer.wrapped, options=StateDictOptions(full_state_dict=True))
    else:
        state = trainer.module.state_dict()
    h = hashlib.sha256()
    for k in sorted(state):
        h.update(k.encode())
        h.update(state[k].detach().float().cpu().numpy().tobytes())
    trainer.close()  # the trainer made the process group: it destroys it, as the command does
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(
        {"digest": h.hexdigest(), "plan": plan, "step": summary["step"], "torn_down": not dist.is_initialized()}
    ))  # fmt: skip
    from spectrain.train.distributed import exit_process

    exit_process(0)  # as `spectrain train` ends a rank: DDP keeps gloo's threads to the end (docs/train.md)


def metrics_rank(rank: int, world: int, port: int, algorithm: str, empty: str, out_dir: str) -> None:
    """Rank 0 trains on a sequence with loss tokens; rank 1 on one without (``empty="no-loss"``)
    or adds no metrics at all (``empty="nothing"``); both reduce with MetricSums."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                           timeout=timedelta(seconds=600))  # fmt: skip
    from _tiny_drafts import random_heads, verifier_info

    from spectrain.data.batch import Batch
    from spectrain.models import build_draft, get_config_class
    from spectrain.train.loop import DistInfo, MetricSums

    V, H, S = 64, 16, 48
    info = verifier_info(V, H, attention_heads=2, kv_heads=1, head_dim=8, intermediate=32, max_positions=256)
    g = torch.Generator().manual_seed(0)
    heads = random_heads(info, g)
    opts = {"block_size": 4, "max_anchors": 8} if algorithm == "dflash" else {"draft_vocab_size": 32}
    torch.manual_seed(0)
    model = build_draft(get_config_class(algorithm)(aux_layer_ids=(1, 2, 3), **opts), heads)
    pos = torch.arange(S)
    loss_mask = torch.full((S,), rank == 0, dtype=torch.bool)
    batch = Batch(torch.randint(0, V, (S,), generator=g), loss_mask, pos, torch.zeros(S, dtype=torch.long),
                  torch.full((S,), S), torch.randn(S, 4, H, generator=g))  # fmt: skip
    sums = MetricSums()
    if rank == 0 or empty == "no-loss":
        with torch.no_grad():
            _, metrics = model(batch, torch.Generator().manual_seed(rank))
        sums.add(metrics)
    alone = sums.summary(DistInfo())
    together = sums.summary(DistInfo(rank, world, rank))
    Path(out_dir, f"metrics{rank}.json").write_text(json.dumps({"alone": alone, "together": together}))
    dist.destroy_process_group()


def control_rank(rank: int, world: int, port: int, out_dir: str) -> None:
    """``init_distributed`` under a default group that is not gloo (NCCL on a GPU host; here
    gloo reporting itself as nccl): per-step decisions go over a gloo group on host tensors."""
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(world),
                       "RANK": str(rank), "LOCAL_RANK": str(rank)})  # fmt: skip
    import torch
    import torch.distributed as dist

    from spectrain.train import distributed

    dist.init_process_group("gloo")
    real = dist.get_backend
    dist.get_backend = lambda group=None: "nccl" if group is None else real(group)
    info = distributed.init_distributed(torch.device("cpu"))
    dist.get_backend = real
    result = {
        "control_backend": None if info.control is None else dist.get_backend(info.control),
        "min_each": distributed.all_min_each([rank + 1, 10 - rank], info),
    }
    distributed.teardown_distributed(info, clean=True)
    result["control_destroyed"] = info.control is None
    result["default_kept"] = dist.is_initialized()  # the caller's group stays the caller's
    Path(out_dir, f"control{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()
