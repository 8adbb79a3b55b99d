"""Checkpoints: ``<save_path>/checkpoint-<step>/`` written atomically beside ``latest``, the
one to resume from, the trainer state (weights, optimizer, RNG, loop state, data cursor), and
pruning.

A checkpoint holds ``config.json`` + ``model.safetensors`` (servable by vLLM as is) and
``trainer/``: ``state.pt`` (full fp32 weights, optimizer, scheduler, RNG, loop state, the data
cursor and the epoch plans) and ``train_config.json`` (the resolved config, secrets redacted).
"""

from __future__ import annotations

import errno
import json
import logging
import os
import random
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from spectrain.models.registry import DraftModel, build_draft, get_config_class
from spectrain.models.verifier import VerifierHeads
from spectrain.train.config import TrainConfig, redact_secrets

if TYPE_CHECKING:
    from spectrain.train.optim import Optimizers

log = logging.getLogger(__name__)

STATE_DIR = "trainer"
LATEST = "latest"
BEST = "best"
"""``<save_path>/best``: the checkpoint of the best validation tau so far (``--save-best``)."""

SPACE_ERRNOS = frozenset({errno.ENOSPC, errno.EFBIG, errno.EDQUOT})
"""Write errors that mean "no room": disk full, file over a size limit, quota exceeded."""


class CheckpointWriteError(RuntimeError):
    """A checkpoint did not fit (one line: the path, the space it needs, what is free). Nothing of
    it is left behind, and the previous checkpoint and ``latest`` are untouched."""


def rng_state() -> dict[str, Any]:
    """Every RNG the run draws from (Python, NumPy, torch, CUDA), to save."""
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what :func:`rng_state` saved."""
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def find_resume(cfg: TrainConfig) -> Path | None:
    """The checkpoint to resume from, or None."""
    if cfg.resume in ("none", "", None):
        return None
    if cfg.resume != "auto":
        p = Path(cfg.resume)
        if not (p / STATE_DIR / "state.pt").is_file():
            raise ValueError(f"--resume {p}: not a checkpoint (no {STATE_DIR}/state.pt)")
        return p
    latest = Path(cfg.save_path) / LATEST
    if latest.is_file():
        p = Path(cfg.save_path) / latest.read_text().strip()
        if (p / STATE_DIR / "state.pt").is_file():
            return p
        log.warning("%s names %s, which is not a complete checkpoint; starting fresh", latest, p)
    return None


def load_trainer_state(checkpoint: Path, world_size: int) -> dict[str, Any]:
    """The trainer state of ``checkpoint``, its data cursor re-split when ``world_size`` differs.

    Another number of processes takes over what the saved ranks had left of the epoch: their
    untrained plan tails, interleaved, dealt out round-robin (``loop["positions"]`` all 0, one
    plan per new rank in ``plans``), so nothing is trained twice and nothing is lost. A checkpoint
    saved between epochs holds no plans (the next epoch is planned for the new ranks); one saved
    mid-epoch without plans (older) still needs the same world size.
    """
    state = torch.load(checkpoint / STATE_DIR / "state.pt", map_location="cpu", weights_only=False)
    loop = state["loop"]
    saved_world = loop["world_size"]
    if saved_world == world_size:
        return state
    plans = state.get("plans")
    if plans is None and not any(loop["positions"]):  # saved between epochs: the next is planned afresh
        state["loop"] = {**loop, "positions": [0] * world_size, "world_size": world_size}
        return state
    if not plans or len(plans) != saved_world:
        raise ValueError(
            f"{checkpoint}: saved with {saved_world} processes, resuming with {world_size}; "
            "this checkpoint holds no per-rank plans to re-split, so resume with the same world size"
        )
    tails = [plan[pos:] for plan, pos in zip(plans, loop["positions"], strict=True)]
    left = []
    for k in range(max(map(len, tails), default=0)):
        left += [t[k] for t in tails if k < len(t)]
    state["plans"] = [left[r::world_size] for r in range(world_size)]
    state["loop"] = {
        **loop,
        "positions": [0] * world_size,
        "world_size": world_size,
        "resplit_from": saved_world,
    }
    log.info("%s: %d processes resume what %d left of epoch %d (%d samples)", checkpoint, world_size,
             saved_world, loop["epoch"], len(left))  # fmt: skip
    return state


def full_states(
    mode: str, wrapped: torch.nn.Module, module: torch.nn.Module, optimizer: Optimizers
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Whole (unsharded) model and optimizer state dicts on the host; under FSDP a collective."""
    if mode == "fsdp":
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
        )

        opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return (get_model_state_dict(wrapped, options=opts),
                get_optimizer_state_dict(wrapped, optimizer.optimizers, options=opts))  # fmt: skip
    model = {k: v.detach().to("cpu", copy=True) for k, v in module.state_dict().items()}
    return model, optimizer.state_dict()


def restore_optimizer(
    mode: str, wrapped: torch.nn.Module, optimizer: Optimizers, state: dict[str, Any]
) -> None:
    """Load the saved optimizer and scheduler state into ``optimizer`` (sharded again under FSDP)."""
    if mode == "fsdp":
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        set_optimizer_state_dict(wrapped, optimizer.optimizers, state["optimizer"],
                                 options=StateDictOptions(full_state_dict=True))  # fmt: skip
    else:
        optimizer.load_state_dict(state["optimizer"])
    optimizer.load_scheduler_state(state["scheduler"])


def write_checkpoint(
    save_path: Path,
    name: str,
    state: dict[str, Any],
    resolved: dict[str, Any],
    export: Callable[[Path], None],
) -> Path:
    """Write ``save_path/name`` atomically (``export`` fills the servable part, then the trainer
    state and the redacted resolved config) and point ``latest`` at it.

    Raises:
        CheckpointWriteError: less space is free than the checkpoint needs (checked before a byte
            is written), or a write ran out of room; the half-written directory is removed and
            ``latest`` still names the checkpoint before.
    """
    final = save_path / name
    tmp = save_path / f".tmp-{name}"
    latest_tmp = save_path / (LATEST + ".tmp")
    need = checkpoint_bytes(state)
    free = shutil.disk_usage(save_path).free
    if free < need:
        raise CheckpointWriteError(_no_room(final, need, free, "not enough free space"))
    try:
        if tmp.exists():
            shutil.rmtree(tmp)
        (tmp / STATE_DIR).mkdir(parents=True)
        export(tmp)
        with open(
            tmp / STATE_DIR / "state.pt", "wb"
        ) as f:  # a file object: torch keeps the OSError as context
            torch.save(state, f)
        (tmp / STATE_DIR / "train_config.json").write_text(
            json.dumps(redact_secrets(resolved), indent=2) + "\n"
        )
        latest_tmp.write_text(name + "\n")
    except Exception as e:
        shutil.rmtree(tmp, ignore_errors=True)
        latest_tmp.unlink(missing_ok=True)
        cause = _space_error(e)
        if cause is None:
            raise
        raise CheckpointWriteError(_no_room(final, need, shutil.disk_usage(save_path).free, cause)) from None
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    os.replace(latest_tmp, save_path / LATEST)
    return final


def checkpoint_bytes(state: dict[str, Any]) -> int:
    """Bytes a checkpoint of ``state`` needs on disk, about: every tensor of the trainer state, the
    fp32 weights once more for the servable export, and 1 MiB of metadata."""
    total = 0

    def walk(x: Any) -> None:
        nonlocal total
        if isinstance(x, torch.Tensor):
            total += x.numel() * x.element_size()
        elif isinstance(x, dict):
            for v in x.values():
                walk(v)
        elif isinstance(x, list | tuple):
            for v in x:
                walk(v)

    walk(state)
    walk(state.get("model", {}))
    return total + (1 << 20)


def _space_error(e: BaseException) -> str | None:
    """The "no room" reason (``strerror``) somewhere in ``e``'s chain, or None for another error.
    torch keeps the OSError as the context of its own error; safetensors names only ``os error N``."""
    seen: BaseException | None = e
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno in SPACE_ERRNOS:
            return seen.strerror or os.strerror(seen.errno)
        m = re.search(r"os error (\d+)", str(seen))
        if m and int(m.group(1)) in SPACE_ERRNOS:
            return os.strerror(int(m.group(1)))
        seen = seen.__cause__ or seen.__context__
    return None


def _no_room(final: Path, need: int, free: int, why: str) -> str:
    return (
        f"{final}: cannot save the checkpoint ({why}): it needs about {need / 2**20:.1f} MiB free in "
        f"{final.parent}, {free / 2**20:.1f} MiB are; nothing was written, `latest` still names the previous one"
    )


def prune_checkpoints(save_path: Path, keep: int | None) -> None:
    """Delete all but the newest ``keep`` checkpoints (None or 0: keep all); the one ``best``
    names (``--save-best``) is always kept."""
    if not keep:
        return
    best = read_pointer(save_path, BEST)
    ckpts = sorted(p for p in save_path.glob("checkpoint-*") if p.is_dir())
    for p in ckpts[:-keep]:
        if p.name != best:
            shutil.rmtree(p, ignore_errors=True)


def read_pointer(save_path: Path, name: str) -> str | None:
    """The checkpoint name held by ``<save_path>/<name>`` (``latest``, ``best``), or None."""
    try:
        return (Path(save_path) / name).read_text().strip() or None
    except OSError:
        return None


def write_pointer(save_path: Path, name: str, checkpoint: str) -> None:
    """Point ``<save_path>/<name>`` at ``checkpoint`` (written aside, then renamed into place)."""
    tmp = Path(save_path) / (name + ".tmp")
    tmp.write_text(checkpoint + "\n")
    os.replace(tmp, Path(save_path) / name)


def load_checkpoint_model(
    checkpoint: str | Path, verifier: str | None = None
) -> tuple[DraftModel, dict[str, Any]]:
    """Rebuild a draft from ``checkpoint`` (fp32 weights); returns ``(model, resolved config)``."""
    ckpt = Path(checkpoint)
    cfg_path = ckpt / STATE_DIR / "train_config.json"
    if not cfg_path.is_file():
        raise ValueError(f"{ckpt}: not a spectrain checkpoint (no {STATE_DIR}/train_config.json)")
    resolved = json.loads(cfg_path.read_text())
    train_cfg = resolved["train"]
    heads = VerifierHeads.load(verifier or train_cfg["verifier"])
    draft_cfg = get_config_class(train_cfg["speculator_type"]).from_dict(
        resolved["draft"], where=str(cfg_path)
    )
    model = build_draft(draft_cfg, heads)
    state = torch.load(ckpt / STATE_DIR / "state.pt", map_location="cpu", weights_only=False)
    model.load_state_dict(state["model"])
    return model, resolved


SHAPE_FIELDS = ("speculator_type", "store", "prompts", "chat_template", "online", "val_fraction", "seed",
                "total_seq_len", "grad_accum")  # fmt: skip
"""TrainConfig fields that shape the model or the data: a resume refuses a change (with the draft's options)."""
PINNED_FIELDS = ("optimizer", "lr", "muon_lr", "weight_decay", "betas", "muon_momentum", "muon_weight_decay",
                 "muon_ns_steps", "muon_adjust_lr", "schedule", "warmup_steps", "warmup_ratio", "min_lr_ratio")  # fmt: skip
"""Fields the checkpoint's optimizer and scheduler state carry (it would win over a new value): refused too."""
MAY_CHANGE = ("epochs", "max_steps", "stop_after_steps", "save_every", "save_every_epochs", "save_best",
              "keep_checkpoints", "val_every", "run_name", "hidden_states_path", "on_missing",
              "val_max_sequences", "log_every", "report_to", "tensorboard", "max_grad_norm", "max_nonfinite_steps",
              "num_workers", "prefetch", "read_threads", "verify_samples", "device", "precision", "compile",
              "endpoints", "online_options", "delete_consumed", "cache_generated", "verifier", "verifier_name")  # fmt: skip
"""Fields a resumed run takes from its command line (docs/train.md lists them)."""

_PATHS = frozenset({"store", "prompts", "chat_template"})


def _norm(key: str, value: Any) -> Any:
    if isinstance(value, tuple | list):
        return [_norm(key, v) for v in value]
    if key in _PATHS and isinstance(value, str) and value and Path(value).exists():
        return str(Path(value).resolve())
    return value


def resume_differences(
    checkpoint: Path, cfg: TrainConfig, saved_draft: dict[str, Any], vocab_size: int | None = None
) -> list[str]:
    """``name (saved -> now)`` for each shaping or pinned field this run sets differently from
    ``checkpoint`` (draft options: those the run names; the rest come from the checkpoint)."""
    out = []
    resolved_path = checkpoint / STATE_DIR / "train_config.json"
    saved_train = json.loads(resolved_path.read_text()).get("train", {}) if resolved_path.is_file() else {}
    now = cfg.to_dict()
    for key in (*SHAPE_FIELDS, *PINNED_FIELDS):
        if key in saved_train and _norm(key, saved_train[key]) != _norm(key, now.get(key)):
            out.append(f"{key} ({saved_train[key]} -> {now.get(key)})")
    for key, value in dict(cfg.draft).items():
        if key not in saved_draft or value is None:
            continue
        saved = saved_draft[key]
        if key == "draft_vocab_size" and vocab_size and saved == vocab_size and value >= vocab_size:
            continue  # clamped to the verifier's vocabulary when the run started
        if _norm(key, value) != _norm(key, saved):
            out.append(f"{key} ({saved} -> {value})")
    return out


def check_resume(
    checkpoint: Path, cfg: TrainConfig, saved_draft: dict[str, Any], vocab_size: int | None
) -> None:
    """Refuse (one line) to resume ``checkpoint`` with a run shaped otherwise."""
    diffs = resume_differences(checkpoint, cfg, saved_draft, vocab_size)
    if diffs:
        raise ValueError(
            f"{checkpoint}: this run differs from the checkpoint's in {', '.join(diffs)}; resuming would train "
            "the checkpoint's: use a new --save-path, or --resume none (--no-resume-from-checkpoint) to start "
            "fresh in this one"
        )
