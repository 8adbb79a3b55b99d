"""A small, fast training configuration for tests of the loop's checks."""

from __future__ import annotations

from spectrain.train.loop import TrainConfig


def small_config(store, verifier, save, **kw) -> TrainConfig:
    """One epoch of DFlash (1 layer, block 4) on 256-token packs, no validation, one checkpoint at the end."""
    base = dict(
        store=str(store), verifier=str(verifier), save_path=str(save), speculator_type="dflash",
        draft={"block_size": 4, "max_anchors": 16, "num_layers": 1}, total_seq_len=256, epochs=1,
        lr=3e-3, save_every=0, log_every=1, num_workers=0, val_fraction=0.0, seed=1, warmup_steps=1,
    )  # fmt: skip
    base.update(kw)
    return TrainConfig(**base)
