"""The verifier families spectrain builds targets for, and what each one's heads need.

The training targets are ``lm_head(norm(h_L))`` from the stored last-layer states; how the
final norm scales and whether the logits are soft-capped differ between families, so each
supported text ``model_type`` (a wrapper's ``text_config.model_type``) is listed here, checked
against transformers' own forward by ``tests/spectrain/models/test_verifier_families.py``. A
``model_type`` not listed is refused (:class:`UnknownFamilyError`), never treated as Llama.

- ``norm_offset``: 1.0 where the RMSNorm scales by ``1 + weight`` (Gemma 2 / 3, Qwen3-Next,
  Qwen3.5), 0.0 where it scales by ``weight`` (Llama, Qwen3, Mistral, gpt-oss, Gemma 4).
- ``embed_scale``: the model multiplies its token embeddings by ``sqrt(hidden_size)`` inside
  its forward (Gemma). vLLM's draft models embed with the target's shared ``embed_tokens``
  table without that factor, so the draft sees unscaled embeddings in training too; the flag
  is informational (the docs table), and the stored layer-0 states carry the scale.
- ``final_logit_softcapping`` is read from the config for every family (Gemma 2 ships 30).
"""

from __future__ import annotations

from dataclasses import dataclass


class UnknownFamilyError(ValueError):
    """A verifier whose ``model_type`` is not a supported family."""


@dataclass(frozen=True)
class Family:
    """What the verifier's heads need for one family of text models."""

    name: str
    """Name in the docs table."""
    model_types: tuple[str, ...]
    """Text ``model_type`` values (``text_config.model_type`` of a multimodal wrapper)."""
    norm_offset: float = 0.0
    embed_scale: bool = False
    wrappers: tuple[str, ...] = ()
    """Wrapper ``model_type`` values whose ``text_config`` is this family (weights under
    ``model.language_model.*``)."""


FAMILIES: tuple[Family, ...] = (
    Family("Llama 3", ("llama",)),
    Family("Mistral", ("mistral",)),
    Family("Qwen2", ("qwen2",)),
    Family("Qwen3", ("qwen3",)),
    Family("Qwen3-MoE", ("qwen3_moe",)),
    Family("Qwen3-VL", ("qwen3_vl_text",), wrappers=("qwen3_vl",)),
    Family("Qwen3-Next (hybrid linear attention)", ("qwen3_next",), norm_offset=1.0),
    Family(
        "Qwen3.5 (hybrid linear attention)",
        ("qwen3_5_text", "qwen3_5_moe_text"),
        norm_offset=1.0,
        wrappers=("qwen3_5", "qwen3_5_moe"),
    ),  # fmt: skip
    Family("gpt-oss", ("gpt_oss",)),
    Family("Gemma 2", ("gemma2",), norm_offset=1.0, embed_scale=True),
    Family("Gemma 3", ("gemma3_text",), norm_offset=1.0, embed_scale=True, wrappers=("gemma3",)),
    Family("Gemma 4", ("gemma4_text",), norm_offset=0.0, embed_scale=True, wrappers=("gemma4",)),
)

_BY_TYPE = {t: f for f in FAMILIES for t in f.model_types}


def supported_model_types() -> list[str]:
    return sorted(_BY_TYPE)


def family_of(model_type: str, where: str = "config.json") -> Family:
    """The family of a text ``model_type``.

    Raises:
        UnknownFamilyError: one line naming ``where`` and the supported types.
    """
    family = _BY_TYPE.get(model_type)
    if family is None:
        raise UnknownFamilyError(
            f"{where}: model_type {model_type!r} is not a supported verifier family "
            f"(supported: {', '.join(supported_model_types())}; see docs/families.md)"
        )
    return family


def final_logit_softcap(cfg: dict) -> float | None:
    """``final_logit_softcapping`` of a (possibly wrapper) config dict, None when unset or 0."""
    text = cfg.get("text_config") or cfg
    value = text.get("final_logit_softcapping", cfg.get("final_logit_softcapping"))
    return float(value) if value else None
