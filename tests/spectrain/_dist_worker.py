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
    from spectrain.train import TrainConfig, Trainer

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
    Path(out_dir, f"rank{rank}.json").write_text(
        json.dumps({"digest": h.hexdigest(), "plan": plan, "step": summary["step"]})
    )
    trainer.close()
    dist.destroy_process_group()
