"""Optimizers and the learning-rate schedule of a training run.

``adamw`` is one AdamW over every trainable parameter. ``muon`` orthogonalises the updates of
the weight matrices with ``torch.optim.Muon`` (every 2-D parameter with both sides > 1 whose
name holds none of ``embed_tokens``, ``lm_head`` and DSpark's ``markov_w1``/``markov_w2``) and gives
the rest (norms, vocabulary rows and tables) to AdamW. Both share one schedule: linear warmup, then cosine, linear or no decay.

:meth:`Optimizers.step` takes a ``skip`` flag that stays on the device: fused AdamW reads it as
its ``found_inf`` (the mechanism ``torch.amp.GradScaler`` uses) and :class:`SkippableMuon` masks
its update with it, so a step with NaN/inf gradients changes nothing and no step waits for the
host to read the flag.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from spectrain.train.muon import MuonSplit, SkippableMuon

log = logging.getLogger(__name__)

__all__ = ["MuonSplit", "OptimConfig", "Optimizers", "SkippableMuon", "build_optimizers", "lr_lambda",
           "split_for_muon"]  # fmt: skip

OPTIMIZERS = ("adamw", "muon")
SCHEDULES = ("cosine", "linear", "constant")
_NOT_MUON = ("embed_tokens", "lm_head", "markov_w1", "markov_w2")


@dataclass
class OptimConfig:
    """The optimizer's settings (``TrainConfig`` carries them under the same names)."""

    optimizer: str = "adamw"
    lr: float = 6e-4
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.95)
    muon_lr: float | None = None
    """Muon's learning rate (None: ``lr``), before ``muon_adjust_lr`` scales it per matrix."""
    muon_momentum: float = 0.95
    muon_weight_decay: float = 0.1
    muon_ns_steps: int = 5
    muon_adjust_lr: str = "match_rms_adamw"
    """``match_rms_adamw`` (update RMS of AdamW: ``0.2 * sqrt(max(rows, cols))``) or ``original``."""

    def check(self) -> None:
        """Raise ``ValueError`` naming the field for an impossible setting."""
        if self.optimizer not in (*OPTIMIZERS, "auto"):
            raise ValueError(f"optimizer: {self.optimizer!r} is not auto | {' | '.join(OPTIMIZERS)}")
        if self.muon_adjust_lr not in ("match_rms_adamw", "original"):
            raise ValueError(f"muon_adjust_lr: {self.muon_adjust_lr!r} is not match_rms_adamw | original")
        if self.muon_ns_steps < 1:
            raise ValueError(f"muon_ns_steps: must be >= 1, got {self.muon_ns_steps}")


def split_for_muon(module: torch.nn.Module) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """``(matrices for Muon, everything else)`` among the trainable parameters of ``module``."""
    muon, other = [], []
    for name, p in module.named_parameters():
        if not p.requires_grad:
            continue
        if p.ndim == 2 and min(p.shape) > 1 and not any(h in name for h in _NOT_MUON):
            muon.append(p)
        else:
            other.append(p)
    return muon, other


def lr_lambda(step: int, total: int, warmup: int, schedule: str, min_ratio: float) -> float:
    """LR multiplier: linear warmup to 1, then cosine/linear decay to ``min_ratio`` (or constant)."""
    if warmup > 0 and step < warmup:
        return (step + 1) / warmup
    if schedule == "constant":
        return 1.0
    span = max(1, total - warmup)
    frac = min(1.0, (step - warmup) / span)
    if schedule == "cosine":
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * frac))
    return min_ratio + (1 - min_ratio) * (1 - frac)


class Optimizers:
    """The run's optimizers, stepped together, each under the same LR schedule."""

    def __init__(
        self, optimizers: list[torch.optim.Optimizer], multiplier: Callable[[int], float], kind: str
    ):
        if not optimizers:
            raise ValueError("no trainable parameters to optimize")
        self.kind = kind
        self.optimizers = optimizers
        self.schedulers = [torch.optim.lr_scheduler.LambdaLR(o, multiplier) for o in optimizers]

    @property
    def flops_per_step(self) -> float:
        """Matmul FLOPs of one optimizer step on this rank: Muon's Newton-Schulz iterations on the
        matrices this rank orthogonalises (all of them unless split, :mod:`spectrain.train.muon`);
        AdamW's elementwise work is not counted."""
        return sum(o.ns_flops() for o in self.optimizers if isinstance(o, SkippableMuon))

    def step(self, skip: torch.Tensor | None = None) -> None:
        """One update of every optimizer, and the schedule's step.

        Args:
            skip: a 0-d bool tensor (on the parameters' device): when true the update is not
                applied (weights, moments and step counters unchanged; the schedule still
                advances). Read on the device, except by an optimizer that cannot (non-fused
                AdamW), for which it is read on the host.
        """
        if skip is not None and not all(_skips_on_device(o) for o in self.optimizers) and bool(skip):
            for s in self.schedulers:
                s.step()
            return
        found_inf = None if skip is None else skip.to(torch.float32)
        for o in self.optimizers:
            if found_inf is not None and _skips_on_device(o):
                o.found_inf = found_inf
            try:
                o.step()
            finally:
                o.found_inf = None
        for s in self.schedulers:
            s.step()

    def zero_grad(self) -> None:
        for o in self.optimizers:
            o.zero_grad(set_to_none=True)

    @property
    def lr(self) -> float:
        """The current learning rate of the last optimizer (AdamW's with Muon)."""
        return float(self.schedulers[-1].get_last_lr()[0])

    def state_dict(self) -> list[dict[str, Any]]:
        return [o.state_dict() for o in self.optimizers]

    def load_state_dict(self, state: list[dict[str, Any]] | dict[str, Any]) -> None:
        states = [state] if isinstance(state, dict) else list(state)
        if len(states) != len(self.optimizers):
            raise ValueError(f"the checkpoint holds {len(states)} optimizer state(s), this run has "
                             f"{len(self.optimizers)} ({self.kind})")  # fmt: skip
        for o, s in zip(self.optimizers, states, strict=True):
            o.load_state_dict(s)

    def scheduler_state(self) -> list[dict[str, Any]]:
        return [s.state_dict() for s in self.schedulers]

    def load_scheduler_state(self, state: list[dict[str, Any]] | dict[str, Any]) -> None:
        states = [state] if isinstance(state, dict) else list(state)
        for s, st in zip(self.schedulers, states, strict=False):
            s.load_state_dict(st)


def _skips_on_device(o: torch.optim.Optimizer) -> bool:
    """Whether ``o.step()`` honours a ``found_inf`` tensor on the device."""
    return isinstance(o, SkippableMuon) or bool(o.defaults.get("fused"))


def build_optimizers(
    module: torch.nn.Module,
    cfg: OptimConfig,
    multiplier: Callable[[int], float],
    *,
    fused: bool = False,
    split: MuonSplit | None = None,
) -> Optimizers:
    """The optimizer(s) of ``cfg.optimizer`` over the trainable parameters of ``module``.

    ``split``: the data-parallel ranks (DDP: the same gradients on every rank) that share Muon's
    Newton-Schulz work; refused for sharded (FSDP) parameters. Ignored for AdamW.
    """
    cfg.check()
    if cfg.optimizer == "auto":
        raise ValueError("optimizer: 'auto' must be resolved to the algorithm's choice first")
    if cfg.optimizer == "adamw":
        params = [p for p in module.parameters() if p.requires_grad]
        adam = torch.optim.AdamW(params, lr=cfg.lr, betas=tuple(cfg.betas), weight_decay=cfg.weight_decay,
                                 fused=fused)  # fmt: skip
        return Optimizers([adam], multiplier, "adamw")
    if not hasattr(torch.optim, "Muon"):
        raise ValueError(
            f"optimizer: muon needs torch.optim.Muon (torch >= 2.9), this is torch {torch.__version__}"
        )
    matrices, rest = split_for_muon(module)
    if split is not None and split.world_size > 1 and any(hasattr(p, "placements") for p in matrices):
        raise ValueError("muon: the Newton-Schulz split needs whole matrices on every rank (DDP); these "
                         "parameters are sharded (FSDP), whose Muon orthogonalises unsplit")  # fmt: skip
    log.info("muon: %d weight matrices, %d other tensors on AdamW", len(matrices), len(rest))
    opts: list[torch.optim.Optimizer] = []
    if matrices:
        opts.append(
            SkippableMuon(
                matrices,
                lr=cfg.muon_lr if cfg.muon_lr is not None else cfg.lr,
                momentum=cfg.muon_momentum,
                weight_decay=cfg.muon_weight_decay,
                ns_steps=cfg.muon_ns_steps,
                adjust_lr_fn=cfg.muon_adjust_lr,
                split=split,
            )  # fmt: skip
        )
    if rest:
        opts.append(torch.optim.AdamW(rest, lr=cfg.lr, betas=tuple(cfg.betas), weight_decay=cfg.weight_decay,
                                      fused=fused))  # fmt: skip
    return Optimizers(opts, multiplier, "muon")
