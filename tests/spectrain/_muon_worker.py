"""One rank of the Muon split tests (spawned by torch.multiprocessing, gloo over a file store)."""

from __future__ import annotations

import contextlib
import copy
from datetime import timedelta
from pathlib import Path

STEPS = 3


def _draft():
    import torch
    from _tiny_drafts import random_heads, verifier_info

    from spectrain.models import build_draft, get_config_class

    V, H = 64, 24
    info = verifier_info(V, H, attention_heads=2, kv_heads=1, head_dim=12, intermediate=40, max_positions=256)
    heads = random_heads(info, torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    cfg = get_config_class("dflash")(aux_layer_ids=(1, 2, 3), block_size=4, max_anchors=8, num_layers=2)
    return build_draft(cfg, heads), V, H


def _batch(rank: int, step: int, V: int, H: int):
    import torch

    from spectrain.data.batch import Batch

    S = 48
    g = torch.Generator().manual_seed(100 * rank + step)
    return Batch(torch.randint(0, V, (S,), generator=g), torch.ones(S, dtype=torch.bool), torch.arange(S),
                 torch.zeros(S, dtype=torch.long), torch.full((S,), S), torch.randn(S, 4, H, generator=g))  # fmt: skip


def muon_rank(rank: int, world: int, init_file: str, out_dir: str) -> None:
    """Train the same tiny DFlash draft under DDP with Muon unsplit, split, and split resumed
    from a step-2 optimizer state; save the weights, the NS call counts and the states."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.optim import _muon

    from spectrain.train.optim import MuonSplit, OptimConfig, build_optimizers
    from spectrain.train.step import train_step

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=300))  # fmt: skip
    calls = [0]
    ns = _muon._zeropower_via_newtonschulz

    def counting(*args, **kwargs):
        calls[0] += 1
        return ns(*args, **kwargs)

    _muon._zeropower_via_newtonschulz = counting

    def build(split: bool):
        model, V, H = _draft()
        wrapped = DDP(model, broadcast_buffers=False)
        opt = build_optimizers(wrapped, OptimConfig(optimizer="muon", lr=1e-3, muon_lr=2e-2), lambda s: 1.0,
                               fused=True, split=MuonSplit(rank, world) if split else None)  # fmt: skip
        return model, wrapped, opt, V, H

    def run(model, wrapped, opt, V, H, steps):
        for step in steps:
            train_step(model, wrapped, opt, [_batch(rank, step, V, H)], [torch.Generator().manual_seed(step)],
                       autocast=contextlib.nullcontext, max_grad_norm=1.0, device=torch.device("cpu"),
                       distributed=True)  # fmt: skip

    out: dict = {}
    for mode in ("unsplit", "split"):
        model, wrapped, opt, V, H = build(mode == "split")
        calls[0] = 0
        run(model, wrapped, opt, V, H, range(2))
        out[f"{mode}_state2"] = copy.deepcopy(opt.state_dict())
        out[f"{mode}_model2"] = {k: v.detach().clone() for k, v in model.state_dict().items()}
        run(model, wrapped, opt, V, H, range(2, STEPS))
        out[f"{mode}_calls"] = calls[0]
        out[f"{mode}_weights"] = {k: v.detach().clone() for k, v in model.state_dict().items()}
        out[f"{mode}_flops"] = opt.flops_per_step
        out["matrices"] = [tuple(p.shape) for p in opt.optimizers[0].param_groups[0]["params"]]
    # resume: the split run's step-2 weights and optimizer state into a fresh model and optimizer
    model, wrapped, opt, V, H = build(True)
    model.load_state_dict(out["split_model2"])
    opt.load_state_dict(copy.deepcopy(out["split_state2"]))  # load_state_dict keeps the tensors it is given
    run(model, wrapped, opt, V, H, range(2, STEPS))
    out["resumed_weights"] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    torch.save(out, Path(out_dir, f"muon{rank}.pt"))
    dist.destroy_process_group()
