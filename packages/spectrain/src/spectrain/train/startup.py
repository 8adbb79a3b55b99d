"""The one line a run logs before its first step: what is about to be trained, on what."""

from __future__ import annotations

from typing import Any


def _count(n: float) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f}{unit}"
    return f"{n:.0f}"


def startup_line(trainer: Any) -> str:
    """``train dflash: N samples, T tokens/epoch, E epochs = S steps, P trainable parameters, ...``.

    Samples and tokens are this rank's share of epoch ``trainer.epoch`` (times the world size);
    tokens are marked ``~`` when the source estimates them (online prompts not yet rendered).
    """
    cfg, source, info = trainer.cfg, trainer.source, trainer.info
    plan = source.plan(trainer.epoch)
    samples = len(plan) * info.world_size
    tokens = "?"
    lengths = getattr(source, "lengths", None)
    if lengths is not None:
        if getattr(source, "lengths_exact", True):
            tokens = _count(sum(lengths(plan)) * info.world_size)
        elif plan:
            head = plan[:256]
            tokens = "~" + _count(sum(lengths(head)) / len(head) * samples)
    params = sum(p.numel() for p in trainer.module.parameters() if p.requires_grad)
    d = trainer.draft_cfg
    layers = len(getattr(trainer.module, "layers", ()) or ())
    start = f" from step {trainer.global_step}" if trainer.global_step else ""
    return (
        f"train {cfg.speculator_type}: {samples} samples, {tokens} tokens per epoch, {cfg.epochs} epochs = "
        f"{trainer.total_steps} steps{start}, {_count(params)} trainable parameters in {layers} draft layers, "
        f"verifier layers {list(d.aux_layer_ids)} -> target {d.target_layer_id}, "
        f"{trainer.device.type}{' bf16' if trainer.amp else ' fp32'}"
        + (f" x {info.world_size} ranks" if info.enabled else "")
    )
