"""The training loop: any :class:`~spectrain.data.SampleSource`, one packed sequence per micro-step.

``train(cfg)`` runs on one process or under ``torchrun`` (DDP, or FSDP2 with
``distributed="fsdp"``). Every ``save_every`` steps and at the end it writes
``<save_path>/checkpoint-<step>/``: ``config.json`` + ``model.safetensors`` (servable by vLLM
as is) and ``trainer/`` (full fp32 weights, optimizer, scheduler, RNG, loop state, the data
cursor and the epoch plans). ``resume="auto"`` continues from ``<save_path>/latest``; the
cursor ``(epoch, position in plan)`` makes sure nothing is trained twice.

Sources: ``spectrain.data.StoreSource`` offline; with ``online=True`` the loop builds
``spectrain.online.OnlineSource(cfg, rank=, world_size=)``, which must offer ``header``
(``layer_ids``, ``hidden_size``) besides the ``SampleSource`` methods, and may offer
``validation_source()`` and ``ids()``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import random
import shutil
import signal
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from spectrain.data import (
    LENGTH_SAMPLE,
    TORCH_DTYPES,
    PackedLoader,
    SampleSource,
    StoreSource,
    estimate_packed_sequences,
)
from spectrain.data import token_frequencies as count_tokens
from spectrain.export import export_draft
from spectrain.loader import BufferPool
from spectrain.models.registry import DraftConfig, DraftModel, build_draft, get_config_class
from spectrain.optim import OptimConfig, Optimizers, build_optimizers, lr_lambda
from spectrain.step import NonFiniteTraining, StepChecks, StepResult, add_sums, train_step
from spectrain.verifier import VerifierHeads

log = logging.getLogger(__name__)

STATE_DIR = "trainer"
LATEST = "latest"


@dataclass
class TrainConfig:
    """Everything a run needs. CLI flags and ``--config`` files fill these fields."""

    verifier: str = ""
    """Local HF directory of the verifier (only embeddings, final norm and LM head are read)."""
    save_path: str = ""
    """Directory for checkpoints, ``metrics.jsonl`` and TensorBoard logs."""
    store: str | None = None
    """Hidden-state store (offline data; online runs use it as their cache)."""
    speculator_type: str = "dflash"
    """Algorithm: ``dflash`` or ``eagle3`` (or any registered one)."""
    draft: dict[str, Any] = field(default_factory=dict)
    """Algorithm options (fields of the algorithm's config dataclass, e.g. ``block_size``)."""
    verifier_name: str | None = None
    """``speculators_config.verifier.name_or_path`` in exports (default: the verifier's ``_name_or_path``)."""
    epochs: int = 1
    max_steps: int | None = None
    """Stop after this many optimizer steps (also sets the LR schedule length)."""
    stop_after_steps: int | None = None
    """Stop (with a checkpoint) at this step without changing the schedule: time-boxed jobs."""
    lr: float = 6e-4
    """Peak learning rate (AdamW; Muon's too unless ``muon_lr`` is set)."""
    optimizer: str = "auto"
    """``adamw``, ``muon`` (``torch.optim.Muon`` on the weight matrices, AdamW on the rest), or
    ``auto``: the algorithm's measured choice (``DraftConfig.default_optimizer``)."""
    muon_lr: float | None = None
    """Muon's peak learning rate (None: ``lr``)."""
    muon_momentum: float = 0.95
    muon_weight_decay: float = 0.1
    muon_ns_steps: int = 5
    """Newton-Schulz iterations of Muon's orthogonalisation."""
    muon_adjust_lr: str = "match_rms_adamw"
    """Muon's per-matrix LR scale: ``match_rms_adamw`` or ``original``."""
    from_pretrained: str | None = None
    """Start from an exported draft directory (ours or speculators'): its architecture and
    weights; ignored when resuming a checkpoint."""
    min_lr_ratio: float = 0.0
    """Final learning rate as a fraction of ``lr``."""
    schedule: str = "cosine"
    """Decay after warmup: ``cosine``, ``linear`` or ``constant``."""
    warmup_steps: int | None = None
    """Linear warmup steps (default: ``warmup_ratio`` of all steps)."""
    warmup_ratio: float = 0.04
    weight_decay: float = 0.0
    """AdamW's weight decay (with Muon: of the tensors AdamW updates)."""
    betas: tuple[float, float] = (0.9, 0.95)
    max_grad_norm: float = 1.0
    """Gradient clipping by global norm (0 disables)."""
    max_nonfinite_steps: int = 10
    """A step whose loss or gradient norm is NaN/inf is skipped (never applied, never exported); this
    many in a row stop the run with an error (found when the step flags are read: every
    ``min(log_every, max_nonfinite_steps)`` steps and before each checkpoint)."""
    total_seq_len: int = 8192
    """Token slots per packed sequence (one sequence per micro-step)."""
    grad_accum: int = 1
    """Packed sequences per optimizer step."""
    seed: int = 0
    val_fraction: float = 0.01
    """Share of sample ids in the validation split (hash of the id)."""
    val_every: int = 0
    """Validate every N steps (0: at the end of each epoch only)."""
    val_max_sequences: int | None = 64
    """Packed validation sequences per rank per validation (None: all)."""
    save_every: int = 1000
    """Checkpoint every N steps (0: only at the end)."""
    keep_checkpoints: int | None = None
    """Keep only the newest N checkpoints (None: keep all)."""
    resume: str = "auto"
    """``auto`` (latest checkpoint in save_path if any), ``none``, or a checkpoint directory."""
    num_workers: int = 0
    """DataLoader reader processes; 0 reads in a prefetch thread (fastest for raw stores, where reads
    are memory copies; use workers for lz4/fp8 stores whose decoding needs CPU). Sources that are
    not worker-safe always read in a thread."""
    prefetch: int = 8
    """Samples read ahead by DataLoader workers (``num_workers > 0``)."""
    read_threads: int = 2
    """Threads reading samples straight into the packed (pinned) sequence buffers; the loader
    prepares ``grad_accum + 1`` sequences ahead of the step, off the training thread."""
    verify_samples: bool = True
    """Check each stored sample's checksum as it is read; a bad sample is skipped with a warning
    naming store, shard and sample (``hsgen verify STORE`` lists them all)."""
    log_every: int = 10
    tensorboard: bool = False
    """Same as ``report_to`` holding ``tensorboard``."""
    report_to: list[str] = field(default_factory=list)
    """Experiment trackers: ``tensorboard``, ``wandb``, ``trackio`` (see :mod:`spectrain.trackers`)."""
    device: str = "auto"
    """``auto`` (cuda if available), ``cuda`` or ``cpu``."""
    precision: str = "auto"
    """``auto`` (bf16 autocast on CUDA, fp32 on CPU), ``bf16`` or ``fp32``."""
    distributed: str = "ddp"
    """Multi-process strategy under torchrun: ``ddp`` or ``fsdp`` (FSDP2, shards every draft layer)."""
    vocab_scan_samples: int = 10000
    """Training samples scanned for token frequencies (draft vocabulary)."""
    compile: bool = False
    """``torch.compile`` the draft's whole training forward (its loss included; under FSDP each
    decoder layer). Off by default until a GPU run measures it (docs/decisions.md)."""
    online: bool = False
    """Generate hidden states from vLLM endpoints while training (spectrain.online)."""
    endpoints: list[str] = field(default_factory=list)
    delete_consumed: bool = False
    cache_generated: bool = False
    prompts: str | None = None
    online_options: dict[str, Any] = field(default_factory=dict)
    """Other ``spectrain.online.OnlineConfig`` fields (shared_dir, scratch_bytes, delete_cached, ...)."""
    chat_template: str | None = None
    """The chat template file the prompts were rendered with when not the verifier's own (checked
    against the store's tokenizer fingerprint; online runs render with it)."""

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["betas"] = list(self.betas)
        return d

    def optim_config(self, default_optimizer: str = "adamw") -> OptimConfig:
        """The optimizer settings among these fields (``auto`` resolved to ``default_optimizer``)."""
        opt = OptimConfig(**{f.name: getattr(self, f.name) for f in dataclasses.fields(OptimConfig)})
        if opt.optimizer == "auto":
            opt.optimizer = default_optimizer
        return opt

    @classmethod
    def from_dict(cls, d: dict[str, Any], *, where: str = "config") -> TrainConfig:
        names = {f.name for f in dataclasses.fields(cls)}
        d = {k.replace("-", "_"): v for k, v in d.items()}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"{where}: unknown option(s) {unknown}")
        if "betas" in d:
            d["betas"] = tuple(d["betas"])
        return cls(**d)

    def validate(self) -> None:
        """Raise ``ValueError`` naming the field for impossible settings."""
        if not self.verifier:
            raise ValueError("verifier: required (a local HF model directory)")
        if not self.save_path:
            raise ValueError("save_path: required")
        if not self.online and not self.store:
            raise ValueError("store: required unless online")
        if self.schedule not in ("cosine", "linear", "constant"):
            raise ValueError(f"schedule: {self.schedule!r} is not cosine | linear | constant")
        if self.distributed not in ("ddp", "fsdp"):
            raise ValueError(f"distributed: {self.distributed!r} is not ddp | fsdp")
        if self.precision not in ("auto", "bf16", "fp32"):
            raise ValueError(f"precision: {self.precision!r} is not auto | bf16 | fp32")
        self.optim_config().check()
        for name in ("epochs", "grad_accum", "total_seq_len", "log_every", "max_nonfinite_steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")


SECRET_FIELDS = frozenset({"api_key", "apikey", "api_token", "access_token", "auth_token", "hf_token", "token",
                           "password", "secret", "authorization"})  # fmt: skip
"""Config field names whose values are secrets (matched case-insensitively, also as ``*_api_key``)."""
REDACTED = "<redacted>"


def redact_secrets(value: Any) -> Any:
    """A copy of ``value`` (dicts, lists, strings) with secret fields and URL credentials replaced.

    Every saved config and summary goes through it: an API key belongs in ``$VLLM_API_KEY``,
    never in a checkpoint.
    """
    if isinstance(value, dict):
        return {k: REDACTED if _is_secret(k) and v else redact_secrets(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [redact_secrets(v) for v in value]
    if isinstance(value, str) and "://" in value and "@" in value.split("://", 1)[1].split("/", 1)[0]:
        scheme, rest = value.split("://", 1)
        return f"{scheme}://{REDACTED}@{rest.split('@', 1)[1]}"
    return value


def _is_secret(key: Any) -> bool:
    k = str(key).lower().replace("-", "_")
    return k in SECRET_FIELDS or k.endswith(("_api_key", "_secret", "_password"))


def load_config_file(path: str | Path) -> dict[str, Any]:
    """Read a JSON or YAML config file into a dict (errors name the file)."""
    path = Path(path)
    text = path.read_text()
    if path.suffix in (".yaml", ".yml"):
        try:
            import yaml
        except ImportError:
            raise ValueError(f"{path}: YAML needs PyYAML (pip install pyyaml) or use JSON") from None
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise ValueError(f"{path}: invalid YAML: {e}") from None
    else:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{e.lineno}: invalid JSON: {e.msg}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: top level must be a mapping")
    return data


# --------------------------------------------------------------------------- setup helpers


@dataclass
class DistInfo:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    control: Any = None
    """The process group of host-side decisions (gloo; None: the default group is gloo already)."""

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_distributed(device: torch.device) -> DistInfo:
    """Join the torchrun process group (``WORLD_SIZE`` > 1): nccl on CUDA, gloo on CPU."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return DistInfo()
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    # per-step decisions (out of data? a stop signal?) go over gloo on host tensors: an NCCL
    # collective read back with .tolist() would wait for every queued kernel each step
    control = dist.new_group(backend="gloo") if dist.get_backend() != "gloo" else None
    return DistInfo(dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", "0")), control)


def resolve_device(cfg: TrainConfig) -> torch.device:
    if cfg.device == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        return torch.device("cpu")
    if cfg.device == "cuda":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device(cfg.device)


def resolve_layers(draft_cfg: DraftConfig, store_layer_ids: Sequence[int], verifier_layers: int) -> list[int]:
    """Fill ``aux_layer_ids``/``target_layer_id``; return indices into the stored layers (aux..., target)."""
    ids = [int(i) for i in store_layer_ids]
    beyond = [i for i in ids if i > verifier_layers]
    if beyond:
        raise ValueError(
            f"the store's layer ids {ids} include {beyond}, beyond the verifier's {verifier_layers} layers "
            f"(ids run from 0, the embeddings, to {verifier_layers}, the last layer): another verifier made it"
        )
    target = draft_cfg.target_layer_id if draft_cfg.target_layer_id is not None else ids[-1]
    if target not in ids:
        raise ValueError(f"target layer {target} is not in the store's layers {ids}")
    if target != verifier_layers:
        log.warning(
            "target layer %d is not the verifier's last layer %d: targets lm_head(norm(h)) assume the last",
            target,
            verifier_layers,
        )
    aux = list(draft_cfg.aux_layer_ids) if draft_cfg.aux_layer_ids else [i for i in ids if i != target]
    missing = [i for i in aux if i not in ids]
    if missing:
        raise ValueError(f"--target-layer-ids {missing} are not in the store's layers {ids}")
    if not aux:
        raise ValueError(f"the store's layers {ids} leave no auxiliary layer besides the target {target}")
    if draft_cfg.algorithm == "eagle3" and len(aux) != 3:
        raise ValueError(
            f"eagle3 needs 3 auxiliary layers; pick 3 of the store's {ids} with --target-layer-ids"
        )
    if aux != sorted(aux):
        log.warning("aux layer ids %s sorted to %s: vLLM concatenates auxiliary states in ascending order",
                    aux, sorted(aux))  # fmt: skip
        aux = sorted(aux)
    if len(set(aux)) != len(aux):
        raise ValueError(f"aux layer ids {aux} repeat a layer")
    draft_cfg.aux_layer_ids = tuple(aux)
    draft_cfg.target_layer_id = target
    return [ids.index(i) for i in aux] + [ids.index(target)]


def check_tokenizer(
    store_fingerprint: str, verifier: str, chat_template: str | None, store: str | None
) -> None:
    """Raise ``ValueError`` when the store was rendered with another tokenizer or chat template.

    The store's header records the fingerprint of the tokenizer and chat template its prompts
    were rendered with (``""`` when unknown, e.g. pre-tokenized input); it must equal the
    verifier's (with ``chat_template`` overriding the verifier's own template, as at generation).
    """
    if not store_fingerprint or not (Path(verifier) / "tokenizer.json").is_file():
        return
    from hsgen.render import ChatRenderer, RenderConfig

    mine = ChatRenderer(RenderConfig(tokenizer_path=verifier, chat_template=chat_template)).fingerprint
    if mine != store_fingerprint:
        hint = (
            "" if chat_template else " (if generate used --chat-template FILE, pass the same --chat-template)"
        )
        raise ValueError(
            f"{store}: rendered with another tokenizer or chat template than the verifier {verifier} "
            f"(fingerprint {store_fingerprint[:12]}..., verifier's {mine[:12]}...){hint}"
        )


def build_source(cfg: TrainConfig, info: DistInfo, split: str = "train") -> SampleSource:
    """StoreSource offline; ``spectrain.online.OnlineSource`` (imported here only) online."""
    if cfg.online:
        from spectrain.online import OnlineSource

        return OnlineSource(cfg, rank=info.rank, world_size=info.world_size)
    return StoreSource(cfg.store, split=split, val_fraction=cfg.val_fraction, seed=cfg.seed, rank=info.rank,
                       world_size=info.world_size, verify=cfg.verify_samples)  # fmt: skip


def _gather(obj: Any, info: DistInfo) -> list[Any]:
    if not info.enabled:
        return [obj]
    out: list[Any] = [None] * info.world_size
    dist.all_gather_object(out, obj)
    return out


def _all_min(value: int, info: DistInfo) -> int:
    return _all_min_each([value], info)[0]


def _all_min_each(values: list[int], info: DistInfo) -> list[int]:
    """Element-wise minimum over ranks, in one host-side collective (no device sync)."""
    if not info.enabled:
        return list(values)
    t = torch.tensor(values, dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=info.control)
    return [int(x) for x in t.tolist()]


class StopSignals:
    """SIGINT and SIGTERM ask training to stop after the current step and save a checkpoint.

    A second signal of the same kind acts as it would without this (SIGINT raises
    ``KeyboardInterrupt``, SIGTERM kills). Handlers are installed only from the main thread.
    """

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        if self.signum is None:
            self.signum = signum
            log.warning("%s: stopping after this step and saving a checkpoint (send it again to abort)",
                        signal.Signals(signum).name)  # fmt: skip
        signal.signal(signum, self._previous[signum])

    def __exit__(self, *exc: Any) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()


def _rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def step_generator(
    seed: int, step: int, rank: int, micro: int, device: torch.device | str = "cpu"
) -> torch.Generator:
    """The RNG of one micro-step (anchors) on ``device``: a pure function of the step, so resume
    repeats it (seeding a CUDA generator sets host-side state only: no sync)."""
    g = torch.Generator(device=device)
    g.manual_seed((seed * 1_000_003 + step * 9_176 + rank * 131 + micro) % (2**63))
    return g


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


# --------------------------------------------------------------------------- metrics


class MetricsLog:
    """JSONL and the ``report_to`` trackers (:mod:`spectrain.trackers`), on rank 0."""

    def __init__(self, save_path: Path, enabled: bool, report_to: Sequence[str] = (),
                 config: dict[str, Any] | None = None):  # fmt: skip
        from spectrain.trackers import Trackers

        self.enabled = enabled
        self.path = save_path / "metrics.jsonl"
        self.trackers = Trackers(list(report_to) if enabled else [], save_path, config)

    def write(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        self.trackers.log(record)

    def close(self) -> None:
        self.trackers.close()


class MetricSums:
    """Accumulates the metric sums models return (on the device, no sync); reduces across ranks.

    Ranks may hold different keys (a rank whose sequences had no anchors or no loss tokens, or
    one that added nothing): :meth:`summary` first agrees on the union of keys and their sizes,
    so every rank enters the same all-reduce with the same vector, zeros for what it lacks.
    """

    def __init__(self):
        self.sums: dict[str, torch.Tensor] = {}

    def add(self, metrics: dict[str, torch.Tensor], keep: torch.Tensor | None = None) -> None:
        """Add ``metrics`` (device tensors; ``keep`` a 0-d bool: false adds zeros, as for a skipped step)."""
        add_sums(self.sums, metrics, keep)

    def _schema(self, info: DistInfo) -> dict[str, tuple[int, ...]]:
        """Every rank's keys and shapes, merged (identical on all ranks)."""
        union: dict[str, tuple[int, ...]] = {}
        for rank, shapes in enumerate(_gather({k: tuple(v.shape) for k, v in self.sums.items()}, info)):
            for k, shape in shapes.items():
                if union.setdefault(k, shape) != shape:
                    raise ValueError(
                        f"metric {k!r} has shape {shape} on rank {rank} but {union[k]} on another"
                    )
        return dict(sorted(union.items()))

    def summary(self, info: DistInfo) -> dict[str, Any]:
        """Loss, per-position accuracy and tau over all ranks (a collective when distributed)."""
        if info.enabled:
            shapes = self._schema(info)
            device = _collective_device()
        else:
            shapes = {k: tuple(v.shape) for k, v in sorted(self.sums.items())}
            device = next(iter(self.sums.values())).device if self.sums else torch.device("cpu")
        if not shapes:
            return {}
        parts = [self.sums[k] if k in self.sums else torch.zeros(shape, dtype=torch.float64) for k, shape in
                 shapes.items()]  # fmt: skip
        flat = torch.cat([p.reshape(-1).to(device) for p in parts])
        if info.enabled:
            dist.all_reduce(flat)
        flat = flat.cpu()
        out, i = {}, 0
        vals = {}
        for k, shape in shapes.items():
            n = torch.Size(shape).numel()
            vals[k] = flat[i : i + n].reshape(shape)
            i += n
        if "acc_correct" in vals:
            tot = vals["acc_total"].clamp_min(1)
            out["acc"] = [round(float(x), 6) for x in (vals["acc_correct"] / tot)]
        if "chains" in vals:
            out["tau"] = round(1.0 + float(vals["accepted_sum"]) / max(1.0, float(vals["chains"])), 6)
        if "loss_sum" in vals:
            out["loss"] = float(vals["loss_sum"]) / max(1e-9, float(vals["weight_sum"]))
        return out


def _collective_device() -> torch.device:
    """Where a reduction runs: NCCL needs the current CUDA device, gloo the CPU."""
    if dist.is_available() and dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class _Window:
    """The steps since the last log record: metric sums and FLOPs on the device, tokens, data
    waits and wall time on the host (validation and checkpoints excluded)."""

    def __init__(self):
        self.sums = MetricSums()
        self.flops: torch.Tensor | float = 0.0
        self.tokens = 0
        self.wait = 0.0
        self.steps = 0
        self.last: StepResult | None = None
        self._t0 = time.perf_counter()
        self._excluded = 0.0

    def add(self, result: StepResult, tokens: int, wait: float) -> None:
        self.sums.add(result.sums, keep=result.applied)  # a skipped step's metrics are not counted
        self.flops = result.flops + self.flops
        self.tokens += tokens
        self.wait += wait
        self.steps += 1
        self.last = result

    def exclude(self, seconds: float) -> None:
        """Leave ``seconds`` (a validation, a checkpoint) out of the window's time."""
        self._excluded += seconds

    def elapsed(self) -> float:
        return time.perf_counter() - self._t0 - self._excluded


# --------------------------------------------------------------------------- the trainer


class Trainer:
    """One training run (see module docstring). ``run()`` returns a summary dict."""

    def __init__(self, cfg: TrainConfig, source: SampleSource | None = None,
                 val_source: SampleSource | None = None):  # fmt: skip
        cfg.validate()
        self.cfg = cfg
        self.device = resolve_device(cfg)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.info = init_distributed(self.device)
        self.save_path = Path(cfg.save_path)
        if self.info.is_main:
            self.save_path.mkdir(parents=True, exist_ok=True)
        self.amp = cfg.precision == "bf16" or (cfg.precision == "auto" and self.device.type == "cuda")
        random.seed(cfg.seed)
        np.random.seed(cfg.seed)
        torch.manual_seed(cfg.seed)

        self.source = source if source is not None else build_source(cfg, self.info)
        self.val_source = val_source
        if self.val_source is None and cfg.val_fraction > 0:
            getter = getattr(self.source, "validation_source", None)
            if getter is not None:
                self.val_source = getter()
            elif isinstance(self.source, StoreSource):
                self.val_source = StoreSource(self.source.path, split="validation", val_fraction=cfg.val_fraction,
                                              seed=cfg.seed, rank=self.info.rank, world_size=self.info.world_size,
                                              verify=cfg.verify_samples)  # fmt: skip
        self._check_there_is_data()

        self.resume_dir = find_resume(cfg)
        self.state: dict[str, Any] | None = None
        if self.resume_dir is not None:
            self.state = torch.load(
                self.resume_dir / STATE_DIR / "state.pt", map_location="cpu", weights_only=False
            )
            saved_world = self.state["loop"]["world_size"]
            if saved_world != self.info.world_size:
                raise ValueError(
                    f"{self.resume_dir}: saved with {saved_world} processes, resuming with {self.info.world_size}; "
                    "the data cursor is per rank, so resume with the same world size"
                )

        vdtype = torch.bfloat16 if self.amp else torch.float32
        self.verifier = VerifierHeads.load(cfg.verifier, dtype=vdtype).to(self.device)
        header = self.source.header
        if int(header.hidden_size) != self.verifier.hidden_size:
            raise ValueError(
                f"store hidden_size {header.hidden_size} differs from verifier {cfg.verifier} "
                f"hidden_size {self.verifier.hidden_size}"
            )
        if not cfg.online:  # the online source checks its store against the prompts' renderer
            check_tokenizer(
                getattr(header, "tokenizer_fingerprint", ""), cfg.verifier, cfg.chat_template, cfg.store
            )
        self.hidden_dtype = TORCH_DTYPES.get(getattr(header, "dtype", "bfloat16"), torch.bfloat16)
        cfg_cls = get_config_class(cfg.speculator_type)
        draft_opts = dict(cfg.draft)
        if self.state is not None:
            draft_opts = self.state["draft_config"]
        layers = self.verifier.info.num_hidden_layers
        if cfg.from_pretrained and self.state is None:
            self.model: DraftModel = self._pretrained(cfg.from_pretrained, draft_opts)
            self.draft_cfg = self.model.cfg
            self.layer_index = resolve_layers(self.draft_cfg, header.layer_ids, layers)
        else:
            self.draft_cfg = cfg_cls.from_dict(draft_opts, where="draft options")
            self.layer_index = resolve_layers(self.draft_cfg, header.layer_ids, layers)
            self.model = build_draft(self.draft_cfg, self.verifier)
        if self.state is not None:
            self.model.load_state_dict(self.state["model"])
        elif self.model.needs_token_counts and not cfg.from_pretrained:
            self.model.prepare(self._token_counts())
        self.model.to(self.device)
        self.module = self.model
        self.wrapped = self._wrap(self.model)
        self.total_steps = self.state["loop"]["total_steps"] if self.state else self._estimate_total_steps()
        warm = cfg.warmup_steps if cfg.warmup_steps is not None else int(cfg.warmup_ratio * self.total_steps)
        self.warmup = warm
        self.optimizer: Optimizers = build_optimizers(
            self.wrapped, cfg.optim_config(self.draft_cfg.default_optimizer),
            lambda s: lr_lambda(s, self.total_steps, warm, cfg.schedule, cfg.min_lr_ratio),
            fused=True,  # fused AdamW skips a non-finite step on the device (spectrain.step)
        )  # fmt: skip
        self.global_step = 0
        self.epoch = 0
        self.position = 0
        self.plans: list[list[str]] | None = None
        self.current_plans: list[list[str]] | None = None
        if self.state is not None:
            self._restore(self.state)
        from spectrain.trackers import parse_report_to

        trackers = parse_report_to([*cfg.report_to, *(["tensorboard"] if cfg.tensorboard else [])])
        self.metrics = MetricsLog(self.save_path, self.info.is_main, trackers, cfg.to_dict())
        self.verifier_name = cfg.verifier_name or self.verifier.info.name_or_path
        self.checks = StepChecks(cfg.max_nonfinite_steps, lambda ids: self._vocab_error(ids))

    # ------------------------------------------------------------------ setup

    def _check_there_is_data(self) -> None:
        """Training on nothing is an error; an empty validation split is worth a warning."""
        cfg = self.cfg
        where = f"--prompts {cfg.prompts}" if cfg.online else f"store {cfg.store}"
        if sum(_gather(len(self.source.plan(0)), self.info)) == 0:
            raise ValueError(
                f"nothing to train on: {where} holds no sample of the training split "
                f"(empty, or every sample falls in the --val-fraction {cfg.val_fraction} validation split)"
            )
        empty_val = self.val_source is not None and sum(_gather(len(self.val_source.plan(0)), self.info)) == 0
        if empty_val and self.info.is_main:  # the gather above is a collective: every rank runs it
            log.warning("%s: the validation split (--val-fraction %g) is empty: no validation", where,
                        cfg.val_fraction)  # fmt: skip

    def _wrap(self, model: DraftModel) -> torch.nn.Module:
        fsdp = self.info.enabled and self.cfg.distributed == "fsdp"
        if self.cfg.compile:
            if fsdp:  # FSDP2's hooks run around each layer: compile the layers, as torchtitan does
                for layer in model.layers:
                    if type(layer).forward is not torch.nn.Module.forward:
                        layer.compile(dynamic=False)
            else:
                model.compile_training()
        if not self.info.enabled:
            return model
        if fsdp:
            from torch.distributed.fsdp import fully_shard

            for layer in model.layers:
                fully_shard(layer)
            fully_shard(model)
            return model
        from torch.nn.parallel import DistributedDataParallel as DDP

        ids = [self.device.index] if self.device.type == "cuda" else None
        return DDP(model, device_ids=ids, broadcast_buffers=False)

    def _pretrained(self, draft_dir: str, options: dict[str, Any]) -> DraftModel:
        """The exported draft at ``draft_dir`` (its weights, vocabulary map and architecture) with
        the run's training options set on its config."""
        from spectrain.draft_io import build_exported_draft, read_draft_algorithm

        algorithm = read_draft_algorithm(draft_dir)
        if algorithm != self.cfg.speculator_type:
            raise ValueError(f"--from-pretrained {draft_dir}: a {algorithm} draft, but speculator_type is "
                             f"{self.cfg.speculator_type}")  # fmt: skip
        model, _ = build_exported_draft(draft_dir, self.verifier, overrides=options)
        log.info("starting from %s (%s)", draft_dir, algorithm)
        return model

    def _token_counts(self) -> torch.Tensor:
        vocab = self.verifier.vocab_size
        counts = torch.zeros(vocab, dtype=torch.float64)
        if self.info.is_main:
            ids_fn = getattr(self.source, "ids", None)
            ids = ids_fn() if ids_fn is not None else self.source.plan(0)
            ids = sorted(ids)[: self.cfg.vocab_scan_samples] if self.cfg.vocab_scan_samples else sorted(ids)
            log.info("counting tokens of %d training samples for the draft vocabulary", len(ids))
            counts = torch.from_numpy(count_tokens(self.source, ids, vocab)).double()
        if self.info.enabled:
            dev = self.device if self.device.type == "cuda" else torch.device("cpu")
            counts = counts.to(dev)
            dist.broadcast(counts, 0)
            counts = counts.cpu()
        return counts

    def _estimate_total_steps(self) -> int:
        cfg = self.cfg
        if cfg.max_steps:
            return cfg.max_steps
        lengths = getattr(self.source, "lengths", None)
        total = 0
        for e in range(cfg.epochs):
            plan = self.source.plan(e)
            if lengths is not None:
                exact = getattr(self.source, "lengths_exact", True)
                seqs = estimate_packed_sequences(plan, lengths, cfg.total_seq_len, exact=exact)
                if not exact and len(plan) > LENGTH_SAMPLE and e == 0:
                    log.info("LR schedule: packed sequences per epoch estimated from %d of %d prompts' rendered "
                             "lengths", LENGTH_SAMPLE, len(plan))  # fmt: skip
            else:
                if e == 0:
                    log.warning("source gives no sample lengths; LR schedule assumes one sample per sequence")
                seqs = len(plan)
            total += _all_min(seqs, self.info) // cfg.grad_accum or 1
        return max(1, total)

    def _restore(self, state: dict[str, Any]) -> None:
        loop = state["loop"]
        if loop.get("distributed") != self._mode():
            raise ValueError(
                f"{self.resume_dir}: saved under {loop.get('distributed')}, resuming under {self._mode()}"
            )
        saved_kind = loop.get("optimizer", "adamw")
        if saved_kind != self.optimizer.kind:
            raise ValueError(f"{self.resume_dir}: trained with optimizer {saved_kind}, resuming with "
                             f"{self.optimizer.kind}")  # fmt: skip
        if self._mode() == "fsdp":
            from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

            set_optimizer_state_dict(self.wrapped, self.optimizer.optimizers, state["optimizer"],
                                     options=StateDictOptions(full_state_dict=True))  # fmt: skip
        else:
            self.optimizer.load_state_dict(state["optimizer"])
        self.optimizer.load_scheduler_state(state["scheduler"])
        _set_rng_state(state["rng"])
        self.global_step = loop["global_step"]
        self.epoch = loop["epoch"]
        self.position = loop["positions"][self.info.rank]
        self.plans = state.get("plans")
        log.info("resumed from %s: step %d, epoch %d, position %d", self.resume_dir, self.global_step, self.epoch,
                 self.position)  # fmt: skip

    def _mode(self) -> str:
        return "none" if not self.info.enabled else self.cfg.distributed

    # ------------------------------------------------------------------ loop

    def _plan(self, epoch: int) -> list[str]:
        plan = self.source.plan(epoch)
        if self.plans is not None and epoch == self.epoch and self.state is not None:
            saved = self.plans[self.info.rank]
            self.plans = None
            if saved != plan:
                log.warning(
                    "epoch %d plan changed since the checkpoint (store grew?); continuing the saved plan",
                    epoch,
                )
                use = getattr(self.source, "use_plan", None)
                if use is not None:
                    use(epoch, saved)
                plan = saved
        self.current_plans = _gather(plan, self.info)
        return plan

    def _loader(self, source: SampleSource, plan: list[str], start: int) -> PackedLoader:
        if getattr(self, "_buffers", None) is None:  # one pool for every epoch and validation
            self._buffers = BufferPool(self.cfg.grad_accum + 4)
        return PackedLoader(
            source, plan, start=start, total_seq_len=self.cfg.total_seq_len, layers=self.layer_index,
            hidden_dtype=self.hidden_dtype, num_workers=self.cfg.num_workers,
            pin_memory=self.device.type == "cuda", prefetch=self.cfg.prefetch, read_threads=self.cfg.read_threads,
            ahead=self.cfg.grad_accum + 1, device=self.device, buffers=self._buffers,
        )  # fmt: skip

    def _autocast(self):
        if self.amp:
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return torch.autocast(self.device.type, enabled=False)

    def run(self) -> dict[str, Any]:
        """Train to the end (or ``max_steps`` / ``stop_after_steps``); returns a summary.

        SIGINT or SIGTERM stops every rank after the same step and saves a checkpoint there;
        the summary then says ``stopped_by``.
        """
        with StopSignals() as signals:
            return self._run(signals)

    def _run(self, signals: StopSignals) -> dict[str, Any]:
        cfg = self.cfg
        from hsgen.progress import progress_bar
        from spectrain.startup import startup_line

        if self.info.is_main:
            log.info("%s", startup_line(self))
        bar = progress_bar(total=self.total_steps, initial=self.global_step, disable=not self.info.is_main, unit="step",
                   desc=f"train {cfg.speculator_type}", dynamic_ncols=True)  # fmt: skip
        window = _Window()
        check_every = max(1, min(cfg.log_every, cfg.max_nonfinite_steps))
        last_saved = -1
        refused = 0
        stop = False
        summary: dict[str, Any] = {}
        try:
            while self.epoch < cfg.epochs and not stop:
                plan = self._plan(self.epoch)
                loader = self._loader(self.source, plan, self.position)
                batches = iter(loader)
                while True:
                    if self._limit_reached():
                        stop = True
                        break
                    t0 = time.perf_counter()
                    micro = []
                    for _ in range(cfg.grad_accum):
                        b = next(batches, None)
                        if b is None:
                            break
                        micro.append(b)
                    wait = time.perf_counter() - t0
                    full = len(micro) == cfg.grad_accum or (not self.info.enabled and len(micro) > 0)
                    # one collective decides for all ranks: a rank out of data ends the epoch, a
                    # signal on any rank stops every rank at this same step
                    go_on, calm = _all_min_each([int(full), int(signals.signum is None)], self.info)
                    if not calm:
                        stop = True
                        summary["stopped_by"] = signal.Signals(signals.signum or signal.SIGTERM).name
                        break
                    if go_on == 0:
                        break
                    result = self._step(micro)  # queued on the device; nothing is read back
                    ids = [s for b in micro for s in b.sample_ids]
                    self.position = micro[-1].plan_end
                    self.source.consumed(ids)
                    self.global_step += 1
                    self.checks.record(self.global_step, result, ids)
                    window.add(result, sum(b.num_tokens for b in micro), wait)
                    bar.update(1)
                    logs = self.global_step % cfg.log_every == 0
                    if logs or self.global_step % check_every == 0:
                        self.checks.check()
                    if logs:
                        rec = self._train_record(window)
                        self.metrics.write(rec)
                        bar.set_postfix(loss=f"{rec['loss']:.4f}", tau=rec.get("tau"))
                        window = _Window()
                    t1 = time.perf_counter()
                    if cfg.val_every and self.global_step % cfg.val_every == 0:
                        summary["validation"] = self.validate()
                    if cfg.save_every and self.global_step % cfg.save_every == 0:
                        self.save()
                        last_saved = self.global_step
                    window.exclude(time.perf_counter() - t1)
                batches.close()
                refused += len(loader.refused)
                if stop:
                    break
                self._skip_rest(plan)
                self.epoch += 1
                self.position = 0
                if self.val_source is not None and not cfg.val_every:
                    summary["validation"] = self.validate()
            if last_saved != self.global_step:
                self.save()
            self.checks.check()
        finally:
            bar.close()
            self.metrics.close()
        summary.update(
            {
                "step": self.global_step,
                "epoch": self.epoch,
                "loss": self.checks.last_loss(),  # None (JSON null) when this run applied no step
                "checkpoint": str(self.last_checkpoint),
                "nonfinite_steps_skipped": self.checks.skipped,
            }
        )
        if refused:
            summary["samples_refused"] = refused  # failed their check as read: skipped (warnings name them)
        stats = getattr(self.source, "stats", None)
        if callable(stats):  # online: samples generated, read, failed (see the failures file)
            summary["data"] = stats()
        return summary

    def _skip_rest(self, plan: list[str]) -> None:
        """Tell the source which samples this epoch leaves untrained (ranks step together, so the
        rank whose samples pack into more sequences drops its last ones, as does a partial
        accumulation under DDP)."""
        rest = plan[self.position :]
        if not rest:
            return
        log.info("epoch %d: the last %d samples of rank %d's plan are not trained (ranks step together)",
                 self.epoch, len(rest), self.info.rank)  # fmt: skip
        skipped = getattr(self.source, "skipped", None)
        if skipped is not None:
            skipped(rest)

    def _limit_reached(self) -> bool:
        cfg = self.cfg
        if cfg.max_steps is not None and self.global_step >= cfg.max_steps:
            return True
        return cfg.stop_after_steps is not None and self.global_step >= cfg.stop_after_steps

    def _step(self, micro: list) -> StepResult:
        """One optimizer step over ``micro`` (:func:`spectrain.step.train_step`): no host-device sync."""
        cfg = self.cfg
        on_host = micro[0].input_ids.device.type == "cpu"
        if on_host:  # host tensors: checked before they are sent, for free
            for b in micro:
                self._check_vocab(b)
        gens = [
            step_generator(cfg.seed, self.global_step, self.info.rank, i, self.device)
            for i in range(len(micro))
        ]
        return train_step(self.module, self.wrapped, self.optimizer, micro, gens, autocast=self._autocast,
                          max_grad_norm=cfg.max_grad_norm, device=self.device, distributed=self.info.enabled,
                          vocab_size=None if on_host else self.verifier.vocab_size)  # fmt: skip

    def _check_vocab(self, b) -> None:
        """Refuse a batch holding token ids the verifier does not have (another tokenizer made it)."""
        top = int(b.input_ids.max()) if b.input_ids.numel() else 0
        if top >= self.verifier.vocab_size:
            raise self._vocab_error(b.sample_ids, top)

    def _vocab_error(self, sample_ids: list[str], top: int | None = None) -> ValueError:
        held = f"token id {top}" if top is not None else "token ids"
        return ValueError(
            f"samples {sample_ids[:4]} hold {held}, beyond the verifier's vocabulary of "
            f"{self.verifier.vocab_size} ({self.cfg.verifier}): they were rendered with another tokenizer"
        )

    def _train_record(self, window: _Window) -> dict[str, Any]:
        """The log record of the steps since the last one (reads the device: the log-interval sync)."""
        summ = window.sums.summary(self.info)
        last = window.last
        grad_norm, loss, flops = torch.stack(
            [last.grad_norm.double(), last.loss.double(), torch.as_tensor(window.flops, dtype=torch.float64,
                                                                         device=last.loss.device)]
        ).tolist()  # fmt: skip
        elapsed = window.elapsed()  # after the reads: the device has done the window's work
        world_tokens = window.tokens * self.info.world_size
        rec = {
            "split": "train",
            "step": self.global_step,
            "epoch": self.epoch,
            "position": self.position,
            "loss": summ.get("loss", loss),
            "lr": self.optimizer.lr,
            "grad_norm": grad_norm,
            "tokens_per_s": world_tokens / max(elapsed, 1e-9),
            "data_wait_s": window.wait / max(window.steps, 1),
            "step_time_s": elapsed / max(window.steps, 1),
            "data_wait_fraction": min(1.0, window.wait / max(elapsed, 1e-9)),
            "flops_per_s": flops / max(elapsed, 1e-9),
            "nonfinite_steps_skipped": self.checks.skipped,
        }
        stats = getattr(self.source, "stats", None)
        if callable(stats):
            rec["data"] = stats()
        if "acc" in summ:
            rec["acc"] = summ["acc"]
        if "tau" in summ:
            rec["tau"] = summ["tau"]
        return rec

    @torch.no_grad()
    def validate(self) -> dict[str, Any]:
        """Loss, per-position accuracy and tau on the validation split (all ranks take part)."""
        if self.val_source is None:
            return {}
        self.module.eval()
        sums = MetricSums()
        n = 0
        plan = self.val_source.plan(0)
        batches = iter(self._loader(self.val_source, plan, 0))
        while True:
            limit = self.cfg.val_max_sequences is not None and n >= self.cfg.val_max_sequences
            b = None if limit else next(batches, None)
            if _all_min(int(b is not None), self.info) == 0:
                break
            b = b.to(self.device, non_blocking=True)
            with self._autocast():
                _, metrics = self.module(b, step_generator(self.cfg.seed, 0, self.info.rank, n, self.device))
            sums.add(metrics)
            n += 1
        batches.close()
        rec = {"split": "validation", "step": self.global_step, "epoch": self.epoch, "sequences": n,
               **sums.summary(self.info)}  # fmt: skip
        self.metrics.write(rec)
        if self.info.is_main:
            log.info("validation step %d: loss %s tau %s acc %s", self.global_step, rec.get("loss"), rec.get("tau"),
                     rec.get("acc"))  # fmt: skip
        return rec

    # ------------------------------------------------------------------ checkpoints

    last_checkpoint: Path | None = None

    def _full_states(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        if self._mode() == "fsdp":
            from torch.distributed.checkpoint.state_dict import (
                StateDictOptions,
                get_model_state_dict,
                get_optimizer_state_dict,
            )

            opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
            return (get_model_state_dict(self.wrapped, options=opts),
                    get_optimizer_state_dict(self.wrapped, self.optimizer.optimizers, options=opts))  # fmt: skip
        model = {k: v.detach().to("cpu", copy=True) for k, v in self.module.state_dict().items()}
        return model, self.optimizer.state_dict()

    def save(self) -> Path:
        """Write ``checkpoint-<step>`` (servable export + trainer state) and point ``latest`` at it."""
        self.checks.check()  # a run over its non-finite limit stops here, before anything is written
        name = f"checkpoint-{self.global_step:08d}"
        final = self.save_path / name
        model_sd, optim_sd = self._full_states()
        bad = [k for k, v in model_sd.items() if v.is_floating_point() and not bool(torch.isfinite(v).all())]
        if bad and self._mode() != "fsdp":  # FSDP gathers the weights on rank 0 only: no rank may raise alone
            raise NonFiniteTraining(f"refusing to save {name}: weights {bad[:3]} hold NaN/inf")
        positions = _gather(self.position, self.info)
        plans = getattr(self, "current_plans", None)
        if self.info.is_main:
            tmp = self.save_path / f".tmp-{name}"
            if tmp.exists():
                shutil.rmtree(tmp)
            (tmp / STATE_DIR).mkdir(parents=True)
            export_draft(self.module, tmp, verifier_name=self.verifier_name,
                         architectures=self.verifier.info.architectures, state=model_sd)  # fmt: skip
            state = {
                "model": model_sd,
                "optimizer": optim_sd,
                "scheduler": self.optimizer.scheduler_state(),
                "rng": _rng_state(),
                "draft_config": self.draft_cfg.to_dict(),
                "loop": {
                    "global_step": self.global_step,
                    "epoch": self.epoch,
                    "positions": positions,
                    "world_size": self.info.world_size,
                    "total_steps": self.total_steps,
                    "distributed": self._mode(),
                    "optimizer": self.optimizer.kind,
                },
                "plans": plans,
            }
            torch.save(state, tmp / STATE_DIR / "state.pt")
            resolved = redact_secrets({"train": self.cfg.to_dict(), "draft": self.draft_cfg.to_dict(),
                                       "loop": state["loop"]})  # fmt: skip
            (tmp / STATE_DIR / "train_config.json").write_text(json.dumps(resolved, indent=2) + "\n")
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
            latest_tmp = self.save_path / (LATEST + ".tmp")
            latest_tmp.write_text(name + "\n")
            os.replace(latest_tmp, self.save_path / LATEST)
            self._prune()
            log.info("saved %s", final)
        if self.info.enabled:
            dist.barrier()
        self.last_checkpoint = final
        return final

    def _prune(self) -> None:
        keep = self.cfg.keep_checkpoints
        if not keep:
            return
        ckpts = sorted(p for p in self.save_path.glob("checkpoint-*") if p.is_dir())
        for p in ckpts[:-keep]:
            shutil.rmtree(p, ignore_errors=True)

    def close(self) -> None:
        self.source.close()
        if self.val_source is not None:
            self.val_source.close()


def train(
    cfg: TrainConfig, source: SampleSource | None = None, val_source: SampleSource | None = None
) -> dict:
    """Run training end to end; returns the summary (last step, loss, checkpoint path, validation)."""
    trainer = Trainer(cfg, source, val_source)
    try:
        return trainer.run()
    finally:
        trainer.close()


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
