"""The algorithm registry: a name -> (config dataclass, draft module class).

A new algorithm is one module ``spectrain/models/<name>.py`` that defines a config dataclass
deriving from :class:`DraftConfig`, decorated with ``@register("<name>")``, and a
:class:`DraftModel` subclass named by the config's ``model_class()``. See
docs/adding-an-algorithm.md.
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

from spectrain.models.layers import RMSNorm

if TYPE_CHECKING:
    from spectrain.data.batch import Batch
    from spectrain.models.verifier import VerifierHeads

log = logging.getLogger(__name__)

_REGISTRY: dict[str, type[DraftConfig]] = {}
BUILTIN = ("dflash", "dspark", "eagle3")


@dataclass
class DraftConfig:
    """Fields every draft has. ``None`` means "take it from the verifier / the store"."""

    algorithm: ClassVar[str] = ""
    RETIRED: ClassVar[tuple[str, ...]] = ()
    """Options that no longer exist; older saved configs holding them still load."""
    default_optimizer: ClassVar[str] = "adamw"
    """What ``--optimizer auto`` means for this algorithm (chosen by measurement, docs/decisions.md)."""

    aux_layer_ids: tuple[int, ...] | None = None
    """vLLM extraction layer ids feeding the draft (a subset of the store's; default: all but the last)."""
    target_layer_id: int | None = None
    """Stored layer id whose states give the targets (default: the store's last, = num_hidden_layers)."""
    num_layers: int = 1
    """Draft decoder layers."""
    num_attention_heads: int | None = None
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    intermediate_size: int | None = None
    draft_vocab_size: int | None = None
    """Reduced draft vocabulary (d2t/t2d built from token frequencies); None = full verifier vocabulary."""
    target_mode: str = "soft"
    """``soft``: KL divergence from the verifier's distribution; ``hard``: cross-entropy against
    its argmax (both built-in algorithms default to ``hard``: docs/decisions.md)."""
    loss_norm: str = "weight"
    """Divide the weighted loss sum by the sum of the weights (``weight``) or by the number of
    trained positions (``count``, speculators; for Eagle3 the steps' means are then summed).
    DFlash defaults to ``count``."""
    sliding_window: int | None = None
    """Earlier positions the draft's attention reaches (speculators' sliding-attention layers):
    DFlash blocks see context slots ``>= anchor - sliding_window``, Eagle3 queries keys
    ``> t - sliding_window``; None = the whole document."""
    attention_backend: str = "auto"
    """``auto`` (flex on CUDA, sdpa on CPU), ``flex`` or ``sdpa``."""

    def __post_init__(self) -> None:
        self.check()

    def check(self) -> None:
        """Raise ``ValueError`` naming the field for an impossible setting; put aux layer ids in
        ascending order (vLLM concatenates the auxiliary states in that order)."""
        self.choose("target_mode", ("soft", "hard"))
        self.choose("loss_norm", ("weight", "count"))
        self.choose("attention_backend", ("auto", "flex", "sdpa"))
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window: must be >= 1, got {self.sliding_window}")
        if self.aux_layer_ids is not None:
            ids = tuple(int(i) for i in self.aux_layer_ids)
            if len(set(ids)) != len(ids):
                raise ValueError(f"aux_layer_ids: {list(ids)} repeats a layer")
            if list(ids) != sorted(ids):
                log.warning("aux_layer_ids %s sorted to %s: vLLM concatenates auxiliary states in "
                            "ascending layer order", list(ids), sorted(ids))  # fmt: skip
            self.aux_layer_ids = tuple(sorted(ids))

    def choose(self, name: str, allowed: Sequence[str]) -> None:
        """Refuse a value of field ``name`` outside ``allowed``."""
        value = getattr(self, name)
        if value not in allowed:
            raise ValueError(f"{name}: {value!r} is not {' | '.join(allowed)}")

    @staticmethod
    def model_class() -> type[DraftModel]:
        raise NotImplementedError

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        for k, v in d.items():
            if isinstance(v, tuple):
                d[k] = list(v)
        return {"algorithm": self.algorithm, **d}

    @classmethod
    def from_dict(cls, d: dict[str, Any], *, where: str = "config") -> DraftConfig:
        """Build from a dict, rejecting unknown keys with a message naming them."""
        d = {k: v for k, v in d.items() if k != "algorithm" and k not in cls.RETIRED}
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"{where}: unknown {cls.algorithm} option(s) {unknown}; known: {sorted(names)}")
        for f in dataclasses.fields(cls):
            if f.name in d and isinstance(d[f.name], list):
                d[f.name] = tuple(d[f.name])
        return cls(**d)


@dataclass
class DraftContext:
    """What a draft sees at inference time (``propose``).

    Attributes:
        aux_hidden_states: the verifier's auxiliary-layer states for context positions
            ``0..T-1``, ``[T, n_aux * H]`` (layers concatenated in ``aux_layer_ids`` order) or
            ``[T, n_aux, H]``.
        token_ids: ``T + 1`` token ids: the context tokens ``0..T-1`` and, last, the bonus token
            the verifier just produced from position ``T - 1``.
    """

    aux_hidden_states: torch.Tensor
    token_ids: Sequence[int] | torch.Tensor


class DraftModel(nn.Module):
    """Base of all drafts. Holds the frozen :class:`VerifierHeads` outside the module tree.

    A training forward is two parts: :meth:`draw` (eager: the step's random draws and attention
    masks, on the batch's device, in shapes that do not depend on the data) and
    :meth:`training_loss` (everything else, with no data-dependent shape and no host-device
    sync, so :meth:`compile_training` can compile it whole). Subclasses implement those two, or
    override :meth:`forward` itself.
    """

    config_class: ClassVar[type[DraftConfig]]

    def __init__(self, cfg: DraftConfig, verifier: VerifierHeads):
        super().__init__()
        self.cfg = cfg
        self.__dict__["verifier"] = verifier
        self.__dict__["_compiled_loss"] = None
        self.last_flops: torch.Tensor | float = 0.0
        """Matmul FLOPs of the last forward + its backward (a device tensor: read it at log time)."""
        self.last_outputs: dict[str, torch.Tensor] = {}

    @property
    def verifier(self) -> VerifierHeads:
        return self.__dict__["verifier"]

    def forward(
        self, batch: Batch, generator: torch.Generator | None = None
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Loss and metric sums (``acc_correct [K]``, ``acc_total [K]``, ``accepted_sum``, ``chains``,
        ``loss_sum``, ``weight_sum``) on one packed sequence; no host-device sync.

        ``generator`` (on the batch's device) drives every random draw: the trainer derives it
        from the step, so a resumed run repeats the draws.
        """
        draws = self.draw(batch, generator)
        fn = self.__dict__["_compiled_loss"] or self.training_loss
        loss, metrics, outputs = fn(batch, draws)
        self.last_flops = outputs.pop("flops", 0.0)
        self.last_outputs = outputs
        return loss, metrics

    def draw(self, batch: Batch, generator: torch.Generator | None = None) -> Any:
        """The step's random draws and attention masks (eager, fixed shapes); passed to :meth:`training_loss`."""
        return None

    def training_loss(
        self, batch: Batch, draws: Any
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor], dict[str, Any]]:
        """``(loss, metric sums, outputs)``; ``outputs`` may hold ``flops`` (see :attr:`last_flops`)
        and what tests and tools read afterwards (:attr:`last_outputs`)."""
        raise NotImplementedError

    def compile_training(self, enable: bool = True, **options: Any) -> None:
        """``torch.compile`` :meth:`training_loss` (``options`` go to ``torch.compile``; default
        ``dynamic=False``: a run's packed sequences all have one shape). A subclass that overrides
        :meth:`forward` instead gets its forward compiled."""
        if not enable:
            self.__dict__["_compiled_loss"] = None
            return
        options.setdefault("dynamic", False)
        if type(self).training_loss is DraftModel.training_loss:
            self.compile(**options)
            return
        self.__dict__["_compiled_loss"] = torch.compile(self.training_loss, **options)

    @torch.no_grad()
    def propose(self, context: DraftContext, num_tokens: int | None = None) -> list[int]:
        """Proposed next tokens (verifier vocabulary ids) after ``context.token_ids``."""
        raise NotImplementedError

    def resolve_decoder_shape(self) -> int:
        """Set the decoder's sizes (config overrides, else the verifier's); returns the hidden size."""
        cfg, info = self.cfg, self.verifier.info
        self.hidden = self.verifier.hidden_size
        self.heads = cfg.num_attention_heads or info.num_attention_heads
        self.kv_heads = cfg.num_key_value_heads or info.num_key_value_heads
        self.head_dim = cfg.head_dim or info.head_dim
        self.intermediate = cfg.intermediate_size or info.intermediate_size
        self.eps = info.rms_norm_eps
        self.theta = info.rope_theta
        return self.hidden

    def reset_parameters(self, std: float = 0.02) -> None:
        """Initialise every trainable linear layer N(0, std) and every RMSNorm to ones."""
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=std)
            elif isinstance(m, RMSNorm):
                nn.init.ones_(m.weight)

    def prepare(self, token_counts: torch.Tensor | None) -> None:
        """Data-dependent setup before training (e.g. the draft vocabulary from token counts)."""

    needs_token_counts: bool = False
    """True when :meth:`prepare` needs token counts of the training data (draft vocabulary)."""

    def vllm_state_dict(self, state: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        """Weights (of ``state``, a full state dict, or the module's own) under vLLM's names."""
        raise NotImplementedError

    def vllm_config(self, verifier_name: str, architectures: Sequence[str]) -> dict[str, Any]:
        """``config.json`` content for vLLM (``speculators_config`` and the algorithm's fields)."""
        raise NotImplementedError

    def flops_per_step(self, batch: Batch) -> float:
        """Matmul FLOPs of one training step (forward + backward) on ``batch``, for MFU."""
        return 0.0

    def backend(self, device: torch.device) -> str:
        """The attention backend used on ``device`` (``auto``: flex on CUDA, sdpa elsewhere)."""
        b = self.cfg.attention_backend
        if b == "auto":
            return "flex" if device.type == "cuda" else "sdpa"
        return b


def register(name: str):
    """Class decorator: register a :class:`DraftConfig` subclass under ``name``."""

    def deco(cls: type[DraftConfig]) -> type[DraftConfig]:
        if name in _REGISTRY and _REGISTRY[name] is not cls:
            raise ValueError(f"algorithm {name!r} registered twice")
        cls.algorithm = name
        _REGISTRY[name] = cls
        return cls

    return deco


def get_config_class(name: str) -> type[DraftConfig]:
    """The config class of algorithm ``name`` (imports ``spectrain.models.<name>``, else an
    installed ``spectrain.algorithms`` entry point of that name, on first use)."""
    if name not in _REGISTRY:
        module = f"spectrain.models.{name}"
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as e:
            if e.name != module:
                raise
    if name not in _REGISTRY:
        from spectrain.models.plugins import load_entry_point

        load_entry_point(name)
    if name not in _REGISTRY:
        raise ValueError(
            f"unknown speculator type {name!r}; available: {available()} (an algorithm of your own: "
            "spectrain --plugin MODULE, SPECTRAIN_PLUGINS, or a 'spectrain.algorithms' entry point; "
            "docs/adding-an-algorithm.md)"
        )
    return _REGISTRY[name]


def available() -> list[str]:
    """Registered algorithm names (built-ins included)."""
    return sorted({*BUILTIN, *_REGISTRY})


def build_draft(cfg: DraftConfig, verifier: VerifierHeads) -> DraftModel:
    """Instantiate the draft module of ``cfg``'s algorithm."""
    return cfg.model_class()(cfg, verifier)
