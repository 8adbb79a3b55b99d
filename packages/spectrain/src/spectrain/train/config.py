"""The run's settings: :class:`TrainConfig`, its file loading and validation, and the secret
redaction every saved config and summary goes through."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from spectrain.train.optim import OptimConfig


@dataclass
class TrainConfig:
    """Everything a run needs. CLI flags and ``--config`` files fill these fields."""

    verifier: str = ""
    """Local HF directory of the verifier (only embeddings, final norm and LM head are read)."""
    save_path: str = ""
    """Directory for checkpoints, ``metrics.jsonl`` and TensorBoard logs."""
    store: str | None = None
    """Hidden-state store (offline data; online runs use it as their cache)."""
    hidden_states_path: str | None = None
    """A speculators hidden-state cache (``hs_<row>.safetensors`` of the prepared dataset
    ``prompts``): imported into ``store`` (default ``<hidden_states_path>.store``) when the run
    starts, and reused (:mod:`spectrain.data.speculators_cache`)."""
    on_missing: str | None = None
    """Rows of the cache without a file: ``generate`` (online), ``skip``, ``warn`` or ``raise``
    (speculators' meanings; default ``generate`` online, ``raise`` offline)."""
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
    save_every_epochs: float | None = None
    """Checkpoint every this many epochs instead (speculators' ``--checkpoint-freq``: 0.5 = twice an
    epoch, 2 = every other epoch), turned into the equivalent step interval at the start of the run
    (logged; ``--dry-run`` shows it) and used in place of ``save_every``."""
    save_best: bool = False
    """After each validation whose tau beats every earlier one, checkpoint that step (if not saved
    already) and name it in ``<save_path>/best``; ``keep_checkpoints`` never prunes it."""
    save_final: bool = True
    """Checkpoint at the end of the run too (False: only every ``save_every`` steps; a benchmark
    or a smoke run that needs no weights, which are ~10 GB for DFlash at 8B)."""
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
    """Experiment trackers: ``tensorboard``, ``wandb``, ``trackio`` (see :mod:`spectrain.train.trackers`)."""
    run_name: str | None = None
    """The trackers' run name and the report's title (default: ``save_path``'s last directory);
    ``{time}``, ``{utc_time}``, ``{rank}`` and ``{local_rank}`` are filled in as speculators does."""
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
        if not self.online and not self.store and not self.hidden_states_path:
            raise ValueError("store: required unless online")
        if self.on_missing not in (None, "generate", "skip", "warn", "raise"):
            raise ValueError(f"on_missing: {self.on_missing!r} is not generate | skip | warn | raise")
        if self.on_missing == "generate" and not self.online:
            raise ValueError("on_missing: generate needs an online run (an --endpoint to generate from)")
        if self.schedule not in ("cosine", "linear", "constant"):
            raise ValueError(f"schedule: {self.schedule!r} is not cosine | linear | constant")
        if self.distributed not in ("ddp", "fsdp"):
            raise ValueError(f"distributed: {self.distributed!r} is not ddp | fsdp")
        if self.precision not in ("auto", "bf16", "fp32"):
            raise ValueError(f"precision: {self.precision!r} is not auto | bf16 | fp32")
        self.optim_config().check()
        if self.save_every_epochs is not None and not self.save_every_epochs > 0:
            raise ValueError(f"save_every_epochs: must be > 0, got {self.save_every_epochs}")
        if self.save_best and self.val_fraction <= 0:
            raise ValueError("save_best: needs a validation split (val_fraction > 0) to find the best tau")
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
    if isinstance(value, str) and "://" in value:  # a URL's userinfo, to its authority's last @
        from hsgen.protocol.extraction import redact_url

        return redact_url(value)
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
