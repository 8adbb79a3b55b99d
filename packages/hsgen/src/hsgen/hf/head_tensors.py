"""Which tensors of a checkpoint are a verifier's heads: embeddings, final norm, LM head.

One rule for every supported layout, shared by ``spectrain.models.verifier`` (which reads the three
tensors) and :mod:`hsgen.hf.hub` (which fetches only the shards that hold them). No torch here.

- the embeddings are the shortest ``*embed_tokens.weight`` outside the decoder layers and the
  vision / audio towers and multi-token-prediction heads: ``model.embed_tokens.weight`` for a
  causal LM, ``model.language_model.embed_tokens.weight`` for a multimodal wrapper (Gemma 3 / 4,
  Qwen3-VL, Qwen3.5);
- the final norm is ``norm.weight`` beside them (same prefix): never a tower's, an MTP head's
  (``mtp.norm.weight`` in Qwen3-Next / Qwen3.5 checkpoints) or a layer's;
- the LM head is the shortest ``*lm_head.weight`` outside those; absent when tied.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

EMBED = "embed_tokens.weight"
NORM = "norm.weight"
LM_HEAD = "lm_head.weight"
_TOWERS = ("vision", "visual", "audio", "mtp.", "mtp_")


class HeadTensorError(ValueError):
    """The checkpoint has no embeddings, or no final norm beside them."""


@dataclass(frozen=True)
class HeadTensorNames:
    """Names of the three head tensors in a checkpoint (``lm_head`` None when tied)."""

    embed_tokens: str
    norm: str
    lm_head: str | None

    def all(self) -> tuple[str, ...]:
        return (self.embed_tokens, self.norm, *([self.lm_head] if self.lm_head else []))


def _outside(name: str) -> bool:
    """Not a decoder layer's tensor nor a tower's / MTP head's."""
    parts = name.split(".")
    if "layers" in parts or "blocks" in parts:
        return False
    return not any(t in name for t in _TOWERS)


def _shortest(names: Iterable[str], suffix: str) -> str | None:
    hits = [n for n in names if (n == suffix or n.endswith("." + suffix)) and _outside(n)]
    return min(hits, key=lambda n: (len(n), n)) if hits else None


def head_tensor_names(names: Iterable[str]) -> HeadTensorNames:
    """The head tensors among ``names`` (all tensor names of a checkpoint).

    Raises:
        HeadTensorError: no ``*embed_tokens.weight``, or no ``norm.weight`` beside it.
    """
    names = set(names)
    embed = _shortest(names, EMBED)
    if embed is None:
        raise HeadTensorError(f"no tensor named '*{EMBED}' outside the decoder layers and towers")
    norm = embed[: -len(EMBED)] + NORM
    if norm not in names:
        raise HeadTensorError(f"no final norm {norm!r} beside {embed!r}")
    return HeadTensorNames(embed, norm, _shortest(names, LM_HEAD))
