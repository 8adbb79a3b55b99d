"""The verifier's frozen heads: token embeddings, final norm and LM head.

Only these three tensors are read from the verifier's safetensors (a single
``model.safetensors`` or a sharded ``model.safetensors.index.json``); the decoder layers are
never loaded. Drafts share the embeddings (and, for DFlash, the LM head) and build their
training targets as ``softcap(lm_head(norm(h_last)))`` from the stored last-layer states. The
norm's offset and the softcap follow the verifier's family (:mod:`spectrain.models.families`); an
unsupported ``model_type`` is refused.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors import safe_open

from hsgen.hf.head_tensors import HeadTensorError, head_tensor_names
from spectrain.models.families import Family, UnknownFamilyError, family_of, final_logit_softcap

log = logging.getLogger(__name__)


class VerifierError(ValueError):
    """The verifier directory is missing a file, a config field or a weight."""


@dataclass(frozen=True)
class VerifierInfo:
    """Shape facts from the verifier's ``config.json`` that drafts and exports need."""

    path: str
    name_or_path: str
    architectures: tuple[str, ...]
    model_type: str
    hidden_size: int
    vocab_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def from_config(cls, path: str | Path, cfg: dict[str, Any]) -> VerifierInfo:
        """Read the fields from a (possibly multimodal: ``text_config``) HF config dict."""
        text = cfg.get("text_config") or cfg
        where = f"{path}/config.json"

        def need(key: str) -> Any:
            if key not in text or text[key] is None:
                raise VerifierError(f"{where}: missing field {key!r}")
            return text[key]

        heads = int(need("num_attention_heads"))
        hidden = int(need("hidden_size"))
        rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
        theta = text.get("rope_theta") or rope.get("rope_theta") or 10000.0
        return cls(
            path=str(path),
            name_or_path=str(cfg.get("_name_or_path") or path),
            architectures=tuple(cfg.get("architectures") or ()),
            model_type=str(text.get("model_type", cfg.get("model_type", ""))),
            hidden_size=hidden,
            vocab_size=int(need("vocab_size")),
            num_hidden_layers=int(need("num_hidden_layers")),
            num_attention_heads=heads,
            num_key_value_heads=int(text.get("num_key_value_heads") or heads),
            head_dim=int(text.get("head_dim") or hidden // heads),
            intermediate_size=int(need("intermediate_size")),
            rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
            rope_theta=float(theta),
            max_position_embeddings=int(text.get("max_position_embeddings", 32768)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", text.get("tie_word_embeddings", False))),
            raw=cfg,
        )


def read_verifier_info(path: str | Path) -> VerifierInfo:
    """Parse ``<path>/config.json`` (raises :class:`VerifierError` naming the file)."""
    path = Path(path)
    cfg_path = path / "config.json"
    if not cfg_path.is_file():
        raise VerifierError(f"{cfg_path}: not found (the verifier must be a local HF model directory)")
    try:
        cfg = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as e:
        raise VerifierError(f"{cfg_path}:{e.lineno}: invalid JSON: {e.msg}") from None
    return VerifierInfo.from_config(path, cfg)


def _weight_files(path: Path) -> dict[str, Path]:
    """Map every tensor name to the safetensors file holding it (reads headers only)."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise VerifierError(f"{index}: not a safetensors index ({e})") from None
        return {name: path / fname for name, fname in weight_map.items()}
    single = path / "model.safetensors"
    if single.is_file():
        with safe_open(str(single), framework="pt") as f:
            return dict.fromkeys(f.keys(), single)
    raise VerifierError(f"{path}: no model.safetensors or model.safetensors.index.json")


class VerifierHeads:
    """Frozen ``embed_tokens`` [V, H], final ``norm`` [H] and ``lm_head`` [V, H] of the verifier.

    A plain holder, not an ``nn.Module``: the tensors never require grad, never appear in a
    draft's state dict and are not sharded or broadcast by DDP/FSDP. Gradients still flow
    through :meth:`logits` to its input.
    """

    def __init__(
        self,
        info: VerifierInfo,
        embed_tokens: torch.Tensor,
        norm_weight: torch.Tensor,
        lm_head: torch.Tensor,
        *,
        norm_offset: float = 0.0,
        softcap: float | None = None,
    ):
        self.info = info
        tied = lm_head is embed_tokens
        self.embed_tokens = embed_tokens.detach().requires_grad_(False)
        self.norm_weight = norm_weight.detach().requires_grad_(False)
        self.lm_head = self.embed_tokens if tied else lm_head.detach().requires_grad_(False)
        self.norm_offset = norm_offset
        self.softcap = softcap
        self.eps = info.rms_norm_eps

    @classmethod
    def load(cls, path: str | Path, *, dtype: torch.dtype = torch.float32) -> VerifierHeads:
        """Load the three tensors from ``path`` (local HF directory) in ``dtype``."""
        path = Path(path)
        info = read_verifier_info(path)
        family = verifier_family(info)
        names = _weight_files(path)
        try:
            heads = head_tensor_names(names)
        except HeadTensorError as e:
            raise VerifierError(f"{path}: {e} in the safetensors files") from None
        embed_name, norm_name, head_name = heads.embed_tokens, heads.norm, heads.lm_head
        tensors = {}
        by_file: dict[Path, list[str]] = {}
        for n in {embed_name, norm_name, *([head_name] if head_name else [])}:
            by_file.setdefault(names[n], []).append(n)
        for fpath, wanted in by_file.items():
            if not fpath.is_file():
                raise VerifierError(f"{fpath}: listed in the index but missing")
            with safe_open(str(fpath), framework="pt") as f:
                for n in wanted:
                    tensors[n] = f.get_tensor(n).to(dtype)
        embed = tensors[embed_name]
        if head_name is None:
            if not info.tie_word_embeddings:
                log.warning("%s: no lm_head.weight and tie_word_embeddings is false; using embeddings", path)
            lm_head = embed
        else:
            lm_head = tensors[head_name]
        if embed.shape[1] != info.hidden_size or lm_head.shape[1] != info.hidden_size:
            raise VerifierError(
                f"{path}: embed {tuple(embed.shape)} / lm_head {tuple(lm_head.shape)} "
                f"do not match hidden_size {info.hidden_size}"
            )
        softcap = final_logit_softcap(info.raw)
        log.info("verifier heads (%s): %s, %s, %s from %s (norm offset %g, softcap %s)", family.name, embed_name,
                 norm_name, head_name or "(tied)", path, family.norm_offset, softcap)  # fmt: skip
        return cls(info, embed, tensors[norm_name], lm_head, norm_offset=family.norm_offset, softcap=softcap)

    @property
    def vocab_size(self) -> int:
        return int(self.lm_head.shape[0])

    @property
    def hidden_size(self) -> int:
        return int(self.lm_head.shape[1])

    def to(self, device: torch.device | str, dtype: torch.dtype | None = None) -> VerifierHeads:
        """Move (and optionally cast) the tensors in place; returns ``self``."""
        tied = self.lm_head is self.embed_tokens
        self.embed_tokens = self.embed_tokens.to(device=device, dtype=dtype)
        self.norm_weight = self.norm_weight.to(device=device, dtype=dtype)
        self.lm_head = self.embed_tokens if tied else self.lm_head.to(device=device, dtype=dtype)
        return self

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings ``[..., H]``, as vLLM's draft models embed: the target's shared
        ``embed_tokens`` rows without the target's own scale (Gemma's ``sqrt(hidden_size)``)."""
        return F.embedding(token_ids, self.embed_tokens)

    def norm(self, hidden: torch.Tensor) -> torch.Tensor:
        """The verifier's final RMSNorm (computed in fp32, returned in the input dtype)."""
        x = hidden.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x * (self.norm_weight.float() + self.norm_offset)).to(hidden.dtype)

    def logits(self, hidden: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        """``softcap(lm_head(norm(hidden)))`` over the full vocabulary, or over the token ids ``rows``."""
        weight = self.lm_head if rows is None else self.lm_head.index_select(0, rows)
        h = self.norm(hidden)
        return apply_softcap(F.linear(h, weight.to(h.dtype)), self.softcap)


def apply_softcap(logits: torch.Tensor, cap: float | None) -> torch.Tensor:
    """``cap * tanh(logits / cap)`` (the config's ``final_logit_softcapping``); ``logits`` when None."""
    if not cap:
        return logits
    return torch.tanh(logits / cap) * cap


def verifier_family(info: VerifierInfo) -> Family:
    """The family of ``info`` (raises :class:`VerifierError` for an unsupported ``model_type``)."""
    try:
        return family_of(info.model_type, f"{info.path}/config.json")
    except UnknownFamilyError as e:
        raise VerifierError(str(e)) from None
