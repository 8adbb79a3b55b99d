"""``spectrain train`` (a click command, loaded lazily by ``spectrain.cli``): the flags into a TrainConfig, then the run."""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
from typing import Any

import click

from spectrain.cli.speculators_flags import SpeculatorsCommand
from spectrain.train.resolve import DEFAULT_SAVE_PATH, DRAFT_FLAGS, TRAIN_FLAGS, ConfigError

__all__ = ["DEFAULT_SAVE_PATH", "DRAFT_FLAGS", "TRAIN_FLAGS", "build_train_config", "train"]


def _click_error(e: ConfigError) -> click.ClickException:
    if e.param_hint is None:
        return click.UsageError(str(e))
    return click.BadParameter(str(e), param_hint=e.param_hint)


def _setup_logging() -> None:
    from hsgen.log_format import setup_logging

    setup_logging(logging.INFO)


def _resolve_verifier(data: dict[str, Any], revision: str | None) -> None:
    from spectrain.train.resolve import resolve_verifier

    try:
        resolve_verifier(data, revision)
    except ConfigError as e:
        raise _click_error(e) from None


def build_train_config(params: dict[str, Any]):
    """Merge defaults < ``--config`` file < flags given on the command line into a TrainConfig
    (:func:`spectrain.train.resolve.resolve_train_config`, its errors as click's)."""
    from spectrain.train.resolve import resolve_train_config

    try:
        return resolve_train_config(params)
    except ConfigError as e:
        raise _click_error(e) from None


TRAIN_SECTIONS: dict[str, tuple[str, ...]] = {
    "Run": ("config", "store", "hidden_states_path", "on_missing", "verifier", "revision", "verifier_name", "speculator_type", "from_pretrained",
            "save_path", "resume", "dry_run", "dump_config"),
    "Optimization": ("epochs", "max_steps", "stop_after_steps", "lr", "min_lr_ratio", "schedule", "warmup_steps",
                     "warmup_ratio", "weight_decay", "betas", "max_grad_norm", "max_nonfinite_steps", "total_seq_len",
                     "grad_accum", "seed"),
    "Optimizer": ("optimizer", "muon_lr", "muon_momentum", "muon_weight_decay", "muon_ns_steps", "muon_adjust_lr"),
    "Recipe (loss, anchors, attention, Eagle3 norms)": (
        "recipe", "loss_weighting", "dpace_alpha", "loss_gamma", "loss_norm", "anchor_rule", "block_attention",
        "sliding_window", "ttt_step_loss_decay", "loss_mask_on", "freeze_lm_head", "norm_before_fc", "norm_output",
        "train_region",
    ),
    "Draft (algorithm options)": ("block_size", "max_anchors", "num_layers", "draft_vocab_size", "mask_token_id",
                                  "ttt_steps", "target_mode", "target_layer_ids", "target_layer_id", "draft_option"),
    "Validation and checkpoints": ("val_fraction", "val_every", "val_max_sequences", "save_every",
                                   "save_every_epochs", "save_best", "save_final", "keep_checkpoints"),
    "Online data (vLLM)": ("online", "endpoint", "prompts", "split", "max_samples", "streaming", "layer_ids",
                           "chat_template", "template_kwargs", "shared_dir", "scratch_dir", "scratch_bytes",
                           "delete_consumed", "cache_generated", "delete_cached", "max_down", "online_option"),
    "Data loading": ("num_workers", "prefetch", "read_threads", "verify_samples", "vocab_scan_samples",
                     "accept_refused"),
    "Hardware": ("device", "precision", "distributed", "compile"),
    "Logging": ("log_every", "tensorboard", "report_to", "run_name", "log_level", "progress"),
}  # fmt: skip


@click.command(
    "train",
    cls=SpeculatorsCommand,
    sections=TRAIN_SECTIONS,
    context_settings={"help_option_names": ["-h", "--help"], "show_default": True},
)
@click.option(
    "--config",
    type=click.Path(exists=True, dir_okay=False),
    help="JSON/YAML file of TrainConfig fields (flags override it).",
)
@click.option("--store", type=click.Path(file_okay=False), help="Hidden-state store directory.")
@click.option(
    "--hidden-states-path",
    type=click.Path(file_okay=False),
    help="A speculators hidden-state cache (hs_<row>.safetensors of the --data-path dataset): imported into "
    "--store [default: DIR.store beside it] on the first run, reused after [default: <data-path>/hidden_states "
    "when it holds files].",
)
@click.option(
    "--on-missing",
    type=click.Choice(["generate", "skip", "warn", "raise"]),
    help="Cache rows without a file: generate them online, skip, warn and skip, or stop the run before it "
    "starts [default: generate online, raise offline].",
)
@click.option(
    "--dry-run",
    is_flag=True,
    default=False,
    help="Print the resolved plan (samples, tokens, steps, FLOPs and peak memory per step) as JSON and exit.",
)
@click.option(
    "--dump-config", is_flag=True, default=False, help="Print the resolved TrainConfig as JSON and exit."
)
@click.option(
    "--verifier",
    "--verifier-name-or-path",
    "verifier",
    help="Verifier: a local HF directory or a hub id like Qwen/Qwen3-8B (only config, tokenizer, "
    "embeddings, final norm and LM head are read, and fetched).",
)
@click.option("--revision", help="Branch, tag or commit of a hub --verifier [default: main].")
@click.option(
    "--verifier-name",
    help="speculators_config.verifier.name_or_path in exports [default: the hub id of --verifier, "
    "else its _name_or_path].",
)
@click.option(
    "--speculator-type",
    type=str,
    metavar="[dflash|eagle3]",
    help="Draft algorithm (default dflash); any registered algorithm name is accepted.",
)
@click.option(
    "--save-path",
    type=click.Path(file_okay=False),
    help=f"Checkpoints, metrics.jsonl, TensorBoard logs (default {DEFAULT_SAVE_PATH}).",
)
@click.option("--epochs", type=int, help="Passes over the training split (default 1).")
@click.option("--max-steps", type=int, help="Stop after N optimizer steps (also the LR schedule length).")
@click.option(
    "--stop-after-steps",
    type=int,
    help="Stop with a checkpoint at step N, schedule unchanged (time-boxed jobs).",
)
@click.option("--lr", type=float, help="Peak learning rate (default 6e-4).")
@click.option(
    "--optimizer",
    type=click.Choice(["auto", "adamw", "muon"]),
    help="adamw; muon: torch.optim.Muon on weight matrices + AdamW on the rest; auto: the algorithm's "
    "measured choice (default auto).",
)
@click.option("--muon-lr", type=float, help="Muon's peak learning rate (default: --lr).")
@click.option("--muon-momentum", type=float, help="Muon's momentum (default 0.95).")
@click.option("--muon-weight-decay", type=float, help="Muon's weight decay (default 0.1).")
@click.option("--muon-ns-steps", type=int, help="Muon's Newton-Schulz iterations (default 5).")
@click.option(
    "--muon-adjust-lr",
    type=click.Choice(["match_rms_adamw", "original"]),
    help="Muon's per-matrix LR scale (default match_rms_adamw).",
)
@click.option(
    "--from-pretrained",
    type=click.Path(exists=True, file_okay=False),
    help="Start from an exported draft (spectrain's or speculators'): its architecture and weights.",
)
@click.option("--min-lr-ratio", type=float, help="Final LR as a fraction of --lr (default 0).")
@click.option(
    "--schedule",
    type=click.Choice(["cosine", "linear", "constant"]),
    help="Decay after warmup (default cosine).",
)
@click.option("--warmup-steps", type=int, help="Linear warmup steps (default: --warmup-ratio of all steps).")
@click.option("--warmup-ratio", type=float, help="Warmup share of all steps (default 0.04).")
@click.option("--weight-decay", type=float, help="AdamW weight decay (default 0).")
@click.option("--betas", help="AdamW betas, 'b1,b2' (default 0.9,0.95).")
@click.option("--max-grad-norm", type=float, help="Gradient clipping norm, 0 = off (default 1.0).")
@click.option(
    "--max-nonfinite-steps",
    type=int,
    help="Steps with a NaN/inf loss or gradient are skipped; this many in a row stop the run (default 10).",
)
@click.option("--total-seq-len", type=int, help="Tokens per packed sequence (default 8192).")
@click.option("--grad-accum", type=int, help="Packed sequences per optimizer step (default 1).")
@click.option("--seed", type=int, help="Seed of plans, anchors and init (default 0).")
@click.option("--val-fraction", type=float, help="Validation share of sample ids (default 0.01).")
@click.option("--val-every", type=int, help="Validate every N steps (default 0 = each epoch end).")
@click.option("--val-max-sequences", type=int, help="Packed validation sequences per rank (default 64).")
@click.option("--save-every", type=int, help="Checkpoint every N steps (default 1000; 0 = end only).")
@click.option(
    "--save-every-epochs",
    type=click.FloatRange(min=0.0, min_open=True),
    help="Checkpoint every F epochs instead, as steps (logged at start; speculators' --checkpoint-freq): "
    "0.5 = twice an epoch.",
)
@click.option(
    "--save-best/--no-save-best",
    default=None,
    help="Checkpoint each validation whose tau beats every earlier one and name it in <save-path>/best "
    "(--keep-checkpoints never prunes it) [default: off].",
)
@click.option(
    "--save-final/--no-save-final",
    default=None,
    help="Checkpoint at the end of the run too (default on; off: only every --save-every steps).",
)
@click.option("--keep-checkpoints", type=int, help="Keep the newest N checkpoints (default all).")
@click.option("--resume", help="auto (latest in --save-path) | none | CHECKPOINT_DIR (default auto).")
@click.option(
    "--num-workers", type=int, help="DataLoader reader processes; 0 = a prefetch thread (default 0)."
)
@click.option("--prefetch", type=int, help="Samples read ahead by --num-workers processes (default 8).")
@click.option("--read-threads", type=int, help="Threads reading samples into the packed buffers (default 2).")
@click.option(
    "--verify-samples/--no-verify-samples",
    default=None,
    help="Check each sample's checksum as it is read; bad ones are skipped (default on).",
)
@click.option("--log-every", type=int, help="Steps per metrics.jsonl record (default 10).")
@click.option("--tensorboard", is_flag=True, default=False, help="Same as --report-to tensorboard.")
@click.option(
    "--report-to",
    "--logger",
    "report_to",
    multiple=True,
    help="Experiment trackers, comma-separated or repeated: tensorboard (<save-path>/tensorboard), wandb, trackio.",
)
@click.option(
    "--run-name",
    help="The trackers' run name and the report's title; {time}, {utc_time}, {rank}, {local_rank} are filled "
    "in [default: --save-path's last directory].",
)
@click.option("--device", help="auto | cuda | cpu (default auto).")
@click.option(
    "--precision", type=click.Choice(["auto", "bf16", "fp32"]), help="auto = bf16 autocast on CUDA."
)
@click.option(
    "--distributed", type=click.Choice(["ddp", "fsdp"]), help="Strategy under torchrun (default ddp)."
)
@click.option(
    "--compile",
    is_flag=True,
    default=False,
    help="torch.compile the draft's whole training forward (loss included; off until measured on a GPU).",
)
@click.option(
    "--vocab-scan-samples",
    type=int,
    help="Samples scanned for draft-vocabulary token counts (default 10000).",
)
@click.option("--block-size", type=int, help="Tokens per block incl. the anchor (dflash 16, dspark 8).")
@click.option("--max-anchors", type=int, help="DFlash: most anchors per packed sequence (default 512).")
@click.option("--num-layers", type=int, help="Draft decoder layers (DFlash default 5; Eagle3 is 1).")
@click.option(
    "--draft-vocab-size",
    type=int,
    help="Reduced draft vocabulary (Eagle3 default 32000; DFlash default full).",
)
@click.option("--mask-token-id", type=int, help="DFlash: mask token id (default vocab_size - 1).")
@click.option("--ttt-steps", type=int, help="Eagle3: training-time-test steps (default 3).")
@click.option(
    "--target-mode",
    type=click.Choice(["soft", "hard"]),
    help="KL to the verifier's distribution, or cross-entropy on its argmax (default hard).",
)
@click.option(
    "--loss-weighting",
    type=click.Choice(["exp-decay", "dpace"]),
    help="DFlash: per-position loss weight (default dpace).",
)
@click.option(
    "--dpace-alpha", type=float, help="DFlash: D-PACE confidence smoothing in (0, 1] (default 0.5)."
)
@click.option("--loss-gamma", type=float, help="DFlash: exp-decay gamma (default 7/5/4 for B = 16/10/8).")
@click.option(
    "--loss-norm",
    type=click.Choice(["weight", "count"]),
    help="Divide the weighted loss by the weight sum or by the trained positions (default: DFlash count, Eagle3 weight).",
)
@click.option(
    "--anchor-rule",
    type=click.Choice(["document", "packed"]),
    help="DFlash: blocks inside the anchor's document, or anywhere in the packed sequence (default document).",
)
@click.option(
    "--block-attention",
    type=click.Choice(["bidirectional", "causal"]),
    help="DFlash: attention inside the block (default bidirectional).",
)
@click.option(
    "--sliding-window", type=int, help="Attention reaches at most N earlier positions (default all)."
)
@click.option(
    "--ttt-step-loss-decay", type=float, help="Eagle3: loss weight decay per TTT step (default 0.8)."
)
@click.option(
    "--loss-mask-on",
    type=click.Choice(["label", "source"]),
    help="Eagle3: loss-mask slot of the predicted token or of the target's verifier position (default label).",
)
@click.option(
    "--train-region",
    type=click.Choice(["loss", "greedy"]),
    help="Slots that train: where the loss mask is 1, or every slot a served draft reaches through the "
    "verifier's greedy tokens, prompts included (default: greedy for Eagle3, loss for DFlash and DSpark).",
)
@click.option(
    "--freeze-lm-head/--no-freeze-lm-head",
    default=None,
    help="Eagle3: keep lm_head at the verifier's rows (default yes).",
)
@click.option(
    "--norm-before-fc/--no-norm-before-fc",
    default=None,
    help="Eagle3: RMSNorm the concatenated aux states before fc (default no).",
)
@click.option(
    "--norm-output/--no-norm-output",
    default=None,
    help="Eagle3: feed post-norm states to the next TTT step (default no).",
)
@click.option(
    "--target-layer-ids",
    help="Stored layer ids feeding the draft, e.g. '2 18 33' (default: all but the last).",
)
@click.option(
    "--target-layer-id",
    type=int,
    help="Stored layer whose states give the targets (default: the store's last).",
)
@click.option(
    "--draft-option", multiple=True, help="Any other algorithm option, KEY=VALUE (JSON value), repeatable."
)
@click.option(
    "--online", is_flag=True, default=False, help="Generate hidden states from vLLM while training."
)
@click.option(
    "--endpoint", "--vllm-endpoint", "endpoint", multiple=True, help="Online: vLLM base URL, repeatable."
)
@click.option(
    "--delete-consumed", is_flag=True, default=False, help="Online: delete samples after training on them."
)
@click.option(
    "--cache-generated", is_flag=True, default=False, help="Online: keep generated samples in --store."
)
@click.option(
    "--prompts",
    "--data-path",
    "prompts",
    help="Online: prompts: a JSONL/JSON/Parquet file, a datasets directory or a hub dataset id.",
)
@click.option("--split", help="Online: split of a dataset --prompts (default train).")
@click.option("--max-samples", type=click.IntRange(min=1), help="Online: rows read from a dataset --prompts.")
@click.option("--streaming", is_flag=True, default=False, help="Online: stream a hub dataset --prompts.")
@click.option(
    "--layer-ids",
    help="Online: layer ids the servers extract (their eagle_aux_hidden_state_layer_ids), e.g. '2,18,33,36' "
    "(default: --target-layer-ids plus the last layer, else the algorithm's default).",
)
@click.option(
    "--chat-template",
    type=click.Path(exists=True, dir_okay=False),
    help="The chat template file the prompts are (online) or were (hsgen generate --chat-template) rendered "
    "with, when not the verifier's own; checked against the store's tokenizer fingerprint.",
)
@click.option(
    "--template-kwargs",
    help="Online: extra chat-template variables as JSON, as hsgen generate takes them, e.g. "
    "'{\"enable_thinking\": false}'.",
)
@click.option("--shared-dir", help="Online: the servers' shared_storage_path as seen here (default /tmp).")
@click.option(
    "--scratch-dir", help="Online: scratch store for generated samples (default /dev/shm if it fits)."
)
@click.option(
    "--scratch-bytes", type=int, help="Online: bound on scratch bytes with --delete-consumed (8 GiB)."
)
@click.option(
    "--delete-cached", is_flag=True, default=False, help="Online: also delete consumed shards of --store."
)
@click.option(
    "--accept-refused",
    type=click.IntRange(min=0),
    default=0,
    show_default=True,
    help="Samples that may be lost (refused as read: a checksum or value check failed; or hidden by "
    "damaged manifest lines) and still exit 0; more exit 3, the summary says how many.",
)
@click.option(
    "--max-down",
    type=click.FloatRange(min=0.0),
    default=None,
    help="Online: end the run (exit 1) when no server has answered for this many seconds, as hsgen "
    "generate's (0 = never give up) [default: 600].",
)
@click.option(
    "--online-option", multiple=True, help="Online: any OnlineConfig field, KEY=VALUE (JSON), repeatable."
)
def train(**params: Any) -> None:
    """Train a DFlash or Eagle3 draft; every checkpoint is a directory vLLM serves.

    speculators' train flags are read too: each works as there or is refused naming ours (docs/train.md)."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return _train(params)
    from hsgen.cli.toolkit import exit_code_of
    from spectrain.train.distributed import exit_process

    exit_process(exit_code_of(_train, params))  # a rank's exit says what happened (docs/train.md)


def _train(params: dict[str, Any]) -> None:
    _setup_logging()
    for note in click.get_current_context().meta.get("speculators_notes", ()):
        logging.getLogger("spectrain.train.loop").info("%s", note)
    try:
        cfg = build_train_config(params)
    except ValueError as e:
        raise click.UsageError(str(e)) from None
    from hsgen.store.errors import StoreError
    from spectrain.train.checkpoint import CheckpointWriteError
    from spectrain.train.config import redact_secrets
    from spectrain.train.distributed import resolve_device
    from spectrain.train.loop import train as run_train

    if params.get("dump_config"):
        click.echo(json.dumps(redact_secrets(cfg.to_dict()), indent=1, default=str))
        return
    try:
        if params.get("dry_run"):
            from spectrain.train.cost import plan

            click.echo(json.dumps(redact_secrets(plan(cfg)), default=str))
            return
        from spectrain.train.cost import check_memory

        check_memory(cfg, resolve_device(cfg))
        summary = run_train(cfg)
    except (ValueError, StoreError, CheckpointWriteError) as e:
        raise click.ClickException(str(e)) from None
    except (RuntimeError, OSError) as e:
        cause = _user_cause(e)
        if cause is None:
            raise
        raise click.ClickException(cause) from None
    refused = int(summary.get("samples_refused") or 0)
    hidden = int(summary.get("samples_hidden") or 0)
    summary["refused_accepted"] = params.get("accept_refused") or 0
    if os.environ.get("RANK", "0") == "0":  # one summary line under torchrun, not one per rank
        click.echo(json.dumps(redact_secrets(summary), default=str))
    if refused + hidden > summary["refused_accepted"]:  # lost data: a run that lost data exits non-zero
        click.echo(f"Error: {_lost_line(refused, hidden)}; --accept-refused {refused + hidden} accepts that loss",
                   err=True)  # fmt: skip
        sys.exit(EXIT_LOST_DATA)
    if summary.get("stopped_by"):  # a checkpoint was saved; 128 + the signal, as a shell reports it
        sys.exit(128 + int(getattr(signal.Signals, summary["stopped_by"])))


def _lost_line(refused: int, hidden: int) -> str:
    """What a run lost, in words: samples refused as read, samples damaged manifest lines hid."""
    parts = []
    if refused:
        parts.append(
            f"{refused} samples were refused as read and trained on nothing (the warnings above name them)"
        )
    if hidden:
        parts.append(f"{hidden} stored samples are hidden by damaged manifest lines and were never trained "
                     "(hsgen verify names them, hsgen gc --repair recovers them)")  # fmt: skip
    return "; ".join(parts)


EXIT_LOST_DATA = 3
"""Exit status of a run that trained but lost samples (as ``hsgen generate``'s partial run)."""


def _user_cause(e: BaseException) -> str | None:
    """The one-line message of an error a user caused (a server down or refusing the key, a path
    not writable), found along ``e``'s cause chain; None for anything else (a bug: traceback)."""
    from hsgen.client.fetch import FetchError

    seen: BaseException | None = e
    while seen is not None:
        if isinstance(seen, FetchError):
            return str(seen)
        if isinstance(seen, OSError) and seen.strerror and seen.filename:
            return f"{seen.strerror}: {seen.filename}"
        seen = seen.__cause__
    return None
