"""Training: the loop (:mod:`~spectrain.train.loop`), its config and set-up, the optimizer step,
optimizers, checkpoints, distribution, metrics and trackers, and the cost of a run before it runs.

The names of the module this folder was (``spectrain.train``) stay importable from it.
"""

from __future__ import annotations

from hsgen._moved import forward

__all__ = [
    "LATEST",
    "REDACTED",
    "SECRET_FIELDS",
    "STATE_DIR",
    "DistInfo",
    "MetricSums",
    "MetricsLog",
    "StopSignals",
    "TrainConfig",
    "Trainer",
    "build_source",
    "check_tokenizer",
    "find_resume",
    "init_distributed",
    "load_checkpoint_model",
    "load_config_file",
    "redact_secrets",
    "resolve_device",
    "resolve_layers",
    "step_generator",
    "train",
]

__getattr__ = forward("spectrain.train.loop", __all__)
