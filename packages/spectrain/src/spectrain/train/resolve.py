"""A run's settings resolved: defaults < a ``--config`` file < the flags given, into one validated
:class:`~spectrain.train.config.TrainConfig` (what ``spectrain train`` runs; the CLI only parses).

A flag that cannot be taken raises :class:`ConfigError` naming the flag, which the CLI shows as
click shows a bad parameter.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from spectrain.train.config import TrainConfig, load_config_file


class ConfigError(ValueError):
    """A flag's value the run cannot take; ``param_hint`` names the flag (``None``: a usage error)."""

    def __init__(self, message: str, param_hint: str | None = None) -> None:
        super().__init__(message)
        self.param_hint = param_hint


DRAFT_FLAGS = (
    "block_size", "max_anchors", "num_layers", "draft_vocab_size", "mask_token_id", "ttt_steps", "target_mode",
    "loss_weighting", "dpace_alpha", "loss_gamma", "loss_norm", "anchor_rule", "block_attention",
    "sliding_window", "ttt_step_loss_decay", "loss_mask_on", "freeze_lm_head", "norm_before_fc", "norm_output",
    "train_region",
)  # fmt: skip
"""Flags that set the draft's config field of the same name."""

TRAIN_FLAGS = (
    "store", "hidden_states_path", "on_missing", "verifier", "verifier_name", "speculator_type", "save_path", "epochs", "max_steps", "stop_after_steps",
    "lr", "min_lr_ratio", "schedule", "warmup_steps", "warmup_ratio", "weight_decay", "max_grad_norm",
    "max_nonfinite_steps",
    "total_seq_len", "grad_accum", "seed", "val_fraction", "val_every", "val_max_sequences", "save_every",
    "save_every_epochs", "save_best", "run_name", "save_final", "keep_checkpoints", "resume", "num_workers", "prefetch", "read_threads", "verify_samples", "log_every", "device",
    "precision", "distributed", "vocab_scan_samples", "prompts", "chat_template", "optimizer", "muon_lr",
    "muon_momentum", "muon_weight_decay", "muon_ns_steps", "muon_adjust_lr", "from_pretrained",
)  # fmt: skip


DEFAULT_SAVE_PATH = "./output/checkpoints"
"""``--save-path`` when neither the flags nor the config file name one (speculators' default)."""


def _json_object(text: str, flag: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"not JSON: {e}", flag) from None
    if not isinstance(value, dict):
        raise ConfigError("must be a JSON object", flag)
    return value


def parse_value(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def resolve_verifier(data: dict[str, Any], revision: str | None) -> None:
    """A hub id as ``verifier`` becomes its cached snapshot (only the heads' shards fetched) and,
    unless given, the ``verifier_name`` the export names (what a bare ``vllm serve <draft>`` needs)."""
    name = data.get("verifier")
    if not name or Path(str(name)).expanduser().is_dir():
        return
    from hsgen.hf.hub import HubError, resolve

    try:
        data["verifier"] = str(resolve(str(name), revision=revision, need="heads"))
    except HubError as e:
        raise ConfigError(str(e), "--verifier") from None
    if not data.get("verifier_name"):
        data["verifier_name"] = str(name)


def resolve_train_config(params: dict[str, Any]) -> TrainConfig:
    """Merge defaults < ``--config`` file < flags given on the command line into a TrainConfig."""
    data: dict[str, Any] = {}
    if params.get("config"):
        data = load_config_file(params["config"])
    draft = dict(data.pop("draft", {}) or {})
    for name in TRAIN_FLAGS:
        if params.get(name) is not None:
            data[name] = params[name]
    for name in DRAFT_FLAGS:
        if params.get(name) is not None:
            draft[name] = params[name]
    if params.get("target_layer_ids"):
        from hsgen.protocol.extraction import parse_layer_ids

        draft["aux_layer_ids"] = parse_layer_ids(params["target_layer_ids"])
    if params.get("target_layer_id") is not None:
        draft["target_layer_id"] = params["target_layer_id"]
    for item in params.get("draft_option") or ():
        if "=" not in item:
            raise ConfigError(f"{item!r}: expected KEY=VALUE", "--draft-option")
        k, v = item.split("=", 1)
        draft[k.strip().replace("-", "_")] = parse_value(v)
    for flag in ("tensorboard", "online", "delete_consumed", "cache_generated", "compile"):
        if params.get(flag):
            data[flag] = True
    if params.get("endpoint"):
        data["endpoints"] = list(params["endpoint"])
    if data.get("endpoints") and not data.get("online"):  # an endpoint is only of use online
        data["online"] = True
    if not data.get("save_path"):
        data["save_path"] = DEFAULT_SAVE_PATH
    online = dict(data.get("online_options") or {})
    for key in ("shared_dir", "scratch_dir", "scratch_bytes", "delete_cached"):
        if params.get(key):
            online[key] = params[key]
    for flag, key in (
        ("split", "prompts_split"),
        ("max_samples", "max_prompts"),
        ("streaming", "prompts_streaming"),
    ):
        if params.get(flag):
            online[key] = params[flag]
    if params.get("layer_ids"):
        from hsgen.protocol.extraction import parse_layer_ids

        try:
            online["layer_ids"] = parse_layer_ids(params["layer_ids"])
        except ValueError as e:
            raise ConfigError(str(e), "--layer-ids") from None
    if params.get("template_kwargs"):
        online["template_kwargs"] = _json_object(params["template_kwargs"], "--template-kwargs")
    if params.get("max_down") is not None:
        online["client_options"] = {**online.get("client_options", {}), "max_down_s": params["max_down"]}
    for item in params.get("online_option") or ():
        if "=" not in item:
            raise ConfigError(f"{item!r}: expected KEY=VALUE", "--online-option")
        k, v = item.split("=", 1)
        online[k.strip().replace("-", "_")] = parse_value(v)
    if online:
        data["online_options"] = online
    if params.get("report_to"):
        from spectrain.train.trackers import parse_report_to

        try:
            data["report_to"] = parse_report_to(params["report_to"])
        except ValueError as e:
            raise ConfigError(str(e).removeprefix("report_to: "), "--report-to") from None
    if params.get("save_every_epochs") is not None and params.get("save_every") is not None:
        raise ConfigError("--save-every and --save-every-epochs (--checkpoint-freq): give one of them")
    if params.get("betas"):
        data["betas"] = [float(x) for x in params["betas"].split(",")]
    data["draft"] = draft
    if data.get("from_pretrained") and not data.get("speculator_type"):
        from spectrain.export.read import read_draft_algorithm

        data["speculator_type"] = read_draft_algorithm(data["from_pretrained"])
    resolve_verifier(data, params.get("revision"))
    if data.get("on_missing") == "generate":
        data["online"] = True
    from spectrain.data.speculators_cache import resolve_flags

    resolve_flags(data)  # --hidden-states-path: a speculators cache or a store
    where = params.get("config") or "command line"
    cfg = TrainConfig.from_dict(data, where=where)
    cfg.validate()
    from spectrain.models import get_config_class

    get_config_class(cfg.speculator_type).from_dict(dict(cfg.draft), where=f"{where}: draft options")
    return cfg


__all__ = [
    "DEFAULT_SAVE_PATH",
    "DRAFT_FLAGS",
    "TRAIN_FLAGS",
    "ConfigError",
    "parse_value",
    "resolve_train_config",
    "resolve_verifier",
]
