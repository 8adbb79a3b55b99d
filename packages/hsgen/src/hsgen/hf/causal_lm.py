"""A checkpoint loaded as the causal LM it is (text in, logits and layer outputs out), and its decoder
layers: what the reference server and ``spectrain eval`` both run."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


def load_causal_lm(path: Path, dtype: torch.dtype) -> Any:
    """The checkpoint's own class: its causal LM, or a multimodal wrapper
    (``*ForConditionalGeneration``: Gemma 3 / 4, Qwen3-VL, Qwen3.5) with all its weights, run
    on text. Loaded ``local_files_only``; not moved, not in eval mode."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    config = AutoConfig.from_pretrained(path, local_files_only=True)
    archs = getattr(config, "architectures", None) or []
    auto = AutoModelForCausalLM
    if any(a.endswith("ForConditionalGeneration") for a in archs) and type(config) in (
        AutoModelForImageTextToText._model_mapping
    ):
        auto = AutoModelForImageTextToText
    return auto.from_pretrained(path, dtype=dtype, local_files_only=True)


def decoder_layers(model: Any) -> Sequence[torch.nn.Module]:
    """The decoder layer list of a HF causal LM (``model.model.layers`` for Llama/Qwen)."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    layers = getattr(decoder, "layers", None)
    if layers is None:
        raise TypeError(f"{type(model).__name__}: cannot find the decoder layers (model.model.layers)")
    return layers


__all__ = ["decoder_layers", "load_causal_lm"]
