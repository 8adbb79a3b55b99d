"""Muon for the trainer: a step that can be skipped on the device, and its Newton-Schulz work
split over data-parallel ranks.

Under DDP every rank holds the same averaged gradients, so every rank used to orthogonalise
every matrix: at the reference DFlash shape that is 98.55 TFLOP per step, more than the step's
forward and backward. With a :class:`MuonSplit` each rank keeps the whole momentum (elementwise,
cheap, and the checkpoint format unchanged), orthogonalises only the matrices it owns
(:func:`assign_owners`: balanced by Newton-Schulz FLOPs, the same on every rank since it depends
on shapes only), and broadcasts those bf16 updates; every rank then applies every update. The
update bytes are the owner's own, so the weights are bitwise those of the unsplit run.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

try:  # torch >= 2.9
    from torch.optim import _muon

    _MuonBase: type = torch.optim.Muon
except ImportError:  # pragma: no cover - old torch: build_optimizers refuses Muon in one line
    _muon = None
    _MuonBase = torch.optim.Optimizer


@dataclass(frozen=True)
class MuonSplit:
    """This process's place among the data-parallel ranks that share Muon's orthogonalisation."""

    rank: int
    world_size: int
    group: Any = None
    """The process group (None: the default group)."""


def ns_flops(shape: tuple[int, ...] | torch.Size, steps: int) -> float:
    """Matmul FLOPs of ``steps`` Newton-Schulz iterations on an ``m x n`` matrix (``m <= n``):
    ``4 m^2 n + 2 m^3`` each (the Gram matrix, its square, the product with the matrix)."""
    m, n = sorted(shape[-2:])
    return steps * (4.0 * m * m * n + 2.0 * m**3)


def assign_owners(shapes: list[tuple[int, ...]], world_size: int, steps: int = 5) -> list[int]:
    """The rank that orthogonalises each matrix: largest first onto the least-loaded rank (ties:
    the earlier matrix, the lower rank), so every rank computes the same assignment."""
    load = [0.0] * world_size
    owners = [0] * len(shapes)
    for i in sorted(range(len(shapes)), key=lambda i: (-ns_flops(shapes[i], steps), i)):
        r = min(range(world_size), key=lambda r: (load[r], r))
        owners[i] = r
        load[r] += ns_flops(shapes[i], steps)
    return owners


def rank_loads(shapes: list[tuple[int, ...]], world_size: int, steps: int = 5) -> list[float]:
    """Newton-Schulz FLOPs of each rank under :func:`assign_owners`."""
    load = [0.0] * world_size
    for shape, r in zip(shapes, assign_owners(shapes, world_size, steps), strict=True):
        load[r] += ns_flops(shape, steps)
    return load


class SkippableMuon(_MuonBase):
    """``torch.optim.Muon`` whose step is skipped on the device when ``found_inf`` (a float 0-d
    tensor, 1 = skip) is set, as fused AdamW's is: the gradient is replaced by zeros, the momentum
    blend weight and the decay become 0 and 1, and the orthogonalised update is multiplied by 0.
    With ``found_inf`` 0 the arithmetic is Muon's, operation for operation (torch's own
    Newton-Schulz and learning-rate adjustment). With ``split`` (more than one rank) each rank
    orthogonalises its share of the matrices and receives the others' (module docstring); the
    gradients must be the same on every rank (DDP), and the parameters whole (not FSDP shards)."""

    def __init__(self, params, *args, split: MuonSplit | None = None, **kwargs):
        super().__init__(params, *args, **kwargs)
        self.split = split if split is not None and split.world_size > 1 else None

    def ns_flops(self) -> float:
        """Newton-Schulz FLOPs of one step on this rank (its share under a split)."""
        total = 0.0
        for group in self.param_groups:
            shapes = [tuple(p.shape) for p in group["params"]]
            owners = self._owners(shapes, group["ns_steps"])
            mine = self.split.rank if self.split else 0
            total += sum(
                ns_flops(s, group["ns_steps"]) for s, r in zip(shapes, owners, strict=True) if r == mine
            )
        return total

    def _owners(self, shapes: list[tuple[int, ...]], steps: int) -> list[int]:
        return assign_owners(shapes, self.split.world_size, steps) if self.split else [0] * len(shapes)

    @torch.no_grad()
    def step(self, closure=None):
        found_inf = getattr(self, "found_inf", None)
        if found_inf is None and self.split is None:
            return super().step(closure)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params, grads, bufs = [], [], []
            self._init_group(group, params, grads, bufs)
            if params:
                self._step_group(group, params, grads, bufs, found_inf)
        return loss

    def _step_group(self, group, params, grads, bufs, found_inf) -> None:
        lr, wd, momentum = group["lr"], group["weight_decay"], group["momentum"]
        if found_inf is None:
            skip, blend, decay, keep = None, 1.0 - momentum, 1.0 - lr * wd, None
        else:
            skip = found_inf.to(params[0].device).bool()
            blend = torch.where(skip, 0.0, 1.0 - momentum)
            decay = torch.where(skip, 1.0, 1.0 - lr * wd)
            keep = (~skip).to(torch.bfloat16)
        owner_of = dict(zip(map(id, group["params"]),
                            self._owners([tuple(p.shape) for p in group["params"]], group["ns_steps"]),
                            strict=True))  # fmt: skip
        owners = [owner_of[id(p)] for p in params]
        mine = self.split.rank if self.split else 0
        updates: list[torch.Tensor | None] = []
        for g, buf, owner in zip(grads, bufs, owners, strict=True):
            if skip is not None:
                g = torch.where(skip, 0.0, g)
            buf.lerp_(g, blend)
            if owner != mine:
                updates.append(None)
                continue
            update = g.lerp(buf, momentum) if group["nesterov"] else buf
            update = _muon._zeropower_via_newtonschulz(update, group["ns_coefficients"], group["ns_steps"],
                                                       group["eps"])  # fmt: skip
            if keep is not None:
                update.mul_(keep.to(update.dtype))
            updates.append(update)

        def apply(i: int, update: torch.Tensor) -> None:
            params[i].mul_(decay)
            params[i].add_(update, alpha=-_muon._adjust_lr(lr, group["adjust_lr_fn"], params[i].shape))

        if self.split is None:
            for i, u in enumerate(updates):
                apply(i, u)
            return
        # one owner at a time, so at most one rank's share of received updates is alive
        for r in range(self.split.world_size):
            idx = [i for i, o in enumerate(owners) if o == r]
            if not idx:
                continue
            sizes = [params[i].numel() for i in idx]
            if r == mine:
                flat = torch.cat([updates[i].reshape(-1) for i in idx])
            else:
                flat = torch.empty(sum(sizes), dtype=torch.bfloat16, device=params[idx[0]].device)
            src = r if self.split.group is None else dist.get_global_rank(self.split.group, r)
            dist.broadcast(flat.view(torch.uint8), src=src, group=self.split.group)  # bytes: any backend
            for i, u in zip(idx, flat.split(sizes), strict=True):
                apply(i, u.view(params[i].shape))
