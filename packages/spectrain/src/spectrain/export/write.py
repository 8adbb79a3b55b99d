"""Write a draft as a directory vLLM serves as it is: ``config.json`` + ``model.safetensors`` (bf16).

One state-dict adapter per algorithm maps the training module's names to vLLM's (stripping
wrapper prefixes such as ``module.`` or ``_orig_mod.``), refuses any name vLLM would not load,
checks the required ones are present and casts: floating tensors to bf16, ``d2t`` to int64,
``t2d`` to bool. Names and fields follow docs/algorithms.md and the checkpoint-format facts.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from spectrain.models.registry import DraftModel

log = logging.getLogger(__name__)

WEIGHTS_NAME = "model.safetensors"
CONFIG_NAME = "config.json"
_WRAPPER_PREFIXES = (
    "module.",
    "_orig_mod.",
    "_fsdp_wrapped_module.",
    "_checkpoint_wrapped_module.",
    "model.",
)


class ExportError(ValueError):
    """A state dict that does not map onto vLLM's weight names."""


@dataclass(frozen=True)
class Adapter:
    """vLLM's weight names for one algorithm, as regular expressions."""

    allowed: tuple[str, ...]
    required: tuple[str, ...]

    def convert(self, state: dict[str, torch.Tensor], algorithm: str) -> dict[str, torch.Tensor]:
        """Strip wrapper prefixes, cast, and check names; raise :class:`ExportError` naming the culprit."""
        out: dict[str, torch.Tensor] = {}
        for name, t in state.items():
            clean = name
            changed = True
            while changed:
                changed = False
                for p in _WRAPPER_PREFIXES:
                    if clean.startswith(p):
                        clean = clean[len(p) :]
                        changed = True
            if not any(re.fullmatch(p, clean) for p in self.allowed):
                raise ExportError(f"{algorithm}: weight {name!r} has no vLLM name (allowed: {self.allowed})")
            out[clean] = _cast(clean, t)
        missing = [r for r in self.required if not any(re.fullmatch(r, n) for n in out)]
        if missing:
            raise ExportError(f"{algorithm}: state dict lacks {missing}")
        return out


_LAYER = r"layers\.\d+\."
_MLP = (_LAYER + r"mlp\.(gate|up|down)_proj\.weight",)
_NORMS = (_LAYER + r"(input_layernorm|post_attention_layernorm)\.weight",)

_DFLASH_ALLOWED = (
    r"fc\.weight",
    r"hidden_norm\.weight",
    _LAYER + r"self_attn\.(q|k|v|o)_proj\.weight",
    _LAYER + r"self_attn\.(q|k)_norm\.weight",
    *_MLP,
    *_NORMS,
    r"norm\.weight",
    r"lm_head\.weight",
    r"embed_tokens\.weight",
    r"d2t",
    r"t2d",
)
_DFLASH_REQUIRED = (
    r"fc\.weight",
    r"hidden_norm\.weight",
    r"norm\.weight",
    r"layers\.0\.self_attn\.q_proj\.weight",
)

ADAPTERS: dict[str, Adapter] = {
    "dflash": Adapter(allowed=_DFLASH_ALLOWED, required=_DFLASH_REQUIRED),
    # vLLM 0.32's Qwen3DSparkModel loads markov_w1/w2 and confidence_head.proj; speculators also
    # writes gate_proj (gated) and joint_proj (rnn), which only spectrain and speculators read
    "dspark": Adapter(
        allowed=(
            *_DFLASH_ALLOWED,
            r"markov_head\.markov_w(1|2)\.weight",
            r"markov_head\.(gate_proj|joint_proj)\.(weight|bias)",
            r"confidence_head\.proj\.(weight|bias)",
        ),
        required=_DFLASH_REQUIRED,
    ),
    "eagle3": Adapter(
        allowed=(
            r"fc\.weight",
            r"layers\.0\.self_attn\.(q|k|v|o)_proj\.weight",
            r"layers\.0\.hidden_norm\.weight",
            r"layers\.0\.(input_layernorm|post_attention_layernorm)\.weight",
            r"layers\.0\.mlp\.(gate|up|down)_proj\.weight",
            r"norm\.weight",
            r"lm_head\.weight",
            r"d2t",
            r"t2d",
            r"input_norm\.weight",
            r"embed_tokens\.weight",
        ),
        required=(
            r"fc\.weight",
            r"lm_head\.weight",
            r"d2t",
            r"t2d",
            r"norm\.weight",
            r"layers\.0\.hidden_norm\.weight",
        ),
    ),
}


def register_adapter(algorithm: str, adapter: Adapter) -> None:
    """Add the vLLM names of a new algorithm."""
    ADAPTERS[algorithm] = adapter


def _cast(name: str, t: torch.Tensor) -> torch.Tensor:
    t = t.detach().to("cpu")
    if name == "d2t":
        return t.to(torch.int64).contiguous()
    if name == "t2d":
        return t.to(torch.bool).contiguous()
    if t.is_floating_point():
        return t.to(torch.bfloat16).contiguous()
    return t.contiguous()


def vllm_weights(model: DraftModel, state: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """The draft's weights under vLLM's names, cast for serving."""
    algorithm = model.cfg.algorithm
    if algorithm not in ADAPTERS:
        raise ExportError(f"no vLLM adapter registered for {algorithm!r}")
    return ADAPTERS[algorithm].convert(model.vllm_state_dict(state), algorithm)


def vllm_refusal(model: DraftModel) -> str | None:
    """Why vLLM cannot serve ``model`` as trained (None: it can); algorithms say it by a
    ``vllm_refusal()`` method."""
    check = getattr(model, "vllm_refusal", None)
    return check() if check is not None else None


_WARNED: set[str] = set()


def speculative_config_for(draft_dir: str | Path, config: dict) -> dict:
    """The ``--speculative-config`` that serves ``draft_dir`` (its exported ``config``) with the trained method.

    vLLM reads ``speculators_model_type`` only for a bare ``vllm serve <draft>``. Given a draft
    through ``--speculative-config`` without ``"method"``, vLLM 0.32 guesses the method from the
    path ("eagle3" / "dflash" in it) and otherwise serves a plain draft model: outputs stay exact
    but the acceptance drops (docs/vllm.md). So every hint names the method.
    """
    tokens = int(config["speculators_config"]["proposal_methods"][0]["speculative_tokens"])
    return {
        "method": config["speculators_model_type"],
        "model": str(draft_dir),
        "num_speculative_tokens": tokens,
    }


def serve_hint(draft_dir: str | Path, config: dict, verifier: str) -> str:
    """The ``vllm serve`` command line for a local verifier, naming the method."""
    return f"vllm serve {verifier} --speculative-config '{json.dumps(speculative_config_for(draft_dir, config))}'"


def export_draft(
    model: DraftModel,
    out_dir: str | Path,
    *,
    verifier_name: str,
    architectures: Sequence[str] = (),
    state: dict[str, torch.Tensor] | None = None,
    include_embeddings: bool = False,
    for_vllm: bool = True,
) -> Path:
    """Write ``config.json`` + ``model.safetensors`` into ``out_dir`` (created if needed).

    ``state``: a full state dict to export instead of the module's own (FSDP gathers one).
    ``include_embeddings``: also write the verifier's ``embed_tokens.weight`` (vLLM shares the
    target's when it is absent; speculators 0.9.0's ``Eagle3DraftModel.from_pretrained`` needs it).
    ``for_vllm``: refuse (:class:`ExportError`, one line) a draft vLLM cannot serve as trained
    (the model's ``vllm_refusal()``, e.g. a gated DSpark head); False writes it anyway, in the
    same format, for ``spectrain eval`` and speculators (the trainer's checkpoints do).
    """
    if for_vllm:
        reason = vllm_refusal(model)
        if reason:
            raise ExportError(f"{model.cfg.algorithm}: vLLM cannot serve this draft: {reason} (export with "
                              "--allow-unservable to write it for spectrain eval and speculators)")  # fmt: skip
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    weights = vllm_weights(model, state)
    if include_embeddings:
        weights["embed_tokens.weight"] = _cast("embed_tokens.weight", model.verifier.embed_tokens)
    config = model.vllm_config(verifier_name, architectures)
    if (os.path.isabs(verifier_name) or verifier_name.startswith(".")) and verifier_name not in _WARNED:
        _WARNED.add(verifier_name)  # once per run, not once per checkpoint
        log.warning(
            "speculators_config.verifier.name_or_path is a local path (%s): a bare `vllm serve <draft>` refuses it; "
            "serve with `%s` (name the method: without it vLLM guesses from the path), or export with "
            "--verifier-name <hub id>",
            verifier_name,
            serve_hint(out, config, verifier_name),
        )
    save_file(weights, str(out / WEIGHTS_NAME), metadata={"format": "pt"})
    os.chmod(out / WEIGHTS_NAME, 0o644)  # safetensors creates it 0600; a serving user must read it
    tmp = out / (CONFIG_NAME + ".tmp")
    tmp.write_text(json.dumps(config, indent=2, sort_keys=False) + "\n")
    os.replace(tmp, out / CONFIG_NAME)
    return out
