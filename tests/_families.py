"""The family matrix: one tiny random model per verifier family, built from transformers' own
config classes, saved like a hub checkpoint (config, safetensors, the tiny tokenizer).

Shapes are small (hidden 64, 4 decoder layers, the tiny tokenizer's vocabulary) so a model
builds in well under a second once its modeling module is imported. Each is made hard to
fake: final-norm weights are random around the family's identity, and the output head is
scaled so logits are tens, like a real model's. Built once per test session
(:func:`family_model_dir`).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HIDDEN = 64
LAYERS = 4
_TEXT = dict(hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=LAYERS, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=4096)  # fmt: skip
_LINEAR = dict(layer_types=["linear_attention", "full_attention"] * 2, linear_num_value_heads=4,
               linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16)  # fmt: skip
_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
_GEMMA4 = dict(hidden_size_per_layer_input=8, layer_types=["sliding_attention", "full_attention"] * 2,
               global_head_dim=16, sliding_window=8)  # fmt: skip
_SIGLIP = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2)
_QWEN_VISION = dict(hidden_size=32, intermediate_size=64, depth=1, num_heads=2, out_hidden_size=HIDDEN)


@dataclass(frozen=True)
class FamilyCase:
    """One row of the matrix: a transformers config / model class pair and its text kwargs."""

    name: str
    config: str
    model: str
    text: dict[str, Any] = field(default_factory=dict)
    wrapper: dict[str, Any] | None = None
    """Non-text kwargs of a multimodal wrapper config (its ``text_config`` is ``text``)."""
    norm_identity: float = 1.0
    """The final-norm weight that scales by one (0 for the ``1 + weight`` families)."""
    weight_prefix: str = "model."
    """Where the decoder's tensors live in the checkpoint."""


CASES: tuple[FamilyCase, ...] = (
    FamilyCase("llama", "LlamaConfig", "LlamaForCausalLM"),
    FamilyCase("llama_tied", "LlamaConfig", "LlamaForCausalLM", dict(tie_word_embeddings=True)),
    FamilyCase("mistral", "MistralConfig", "MistralForCausalLM", dict(sliding_window=8)),
    FamilyCase("qwen2", "Qwen2Config", "Qwen2ForCausalLM"),
    FamilyCase("qwen3", "Qwen3Config", "Qwen3ForCausalLM"),
    FamilyCase("qwen3_moe", "Qwen3MoeConfig", "Qwen3MoeForCausalLM", _MOE),
    FamilyCase(
        "qwen3_next",
        "Qwen3NextConfig",
        "Qwen3NextForCausalLM",
        dict(_MOE, **_LINEAR, shared_expert_intermediate_size=32),
        norm_identity=0.0,
    ),  # fmt: skip
    FamilyCase("qwen3_5_text", "Qwen3_5TextConfig", "Qwen3_5ForCausalLM", _LINEAR, norm_identity=0.0),
    FamilyCase(
        "qwen3_5",
        "Qwen3_5Config",
        "Qwen3_5ForConditionalGeneration",
        _LINEAR,
        dict(vision_config=_QWEN_VISION),
        norm_identity=0.0,
        weight_prefix="model.language_model.",
    ),  # fmt: skip
    FamilyCase(
        "qwen3_vl",
        "Qwen3VLConfig",
        "Qwen3VLForConditionalGeneration",
        {},
        dict(vision_config=dict(_QWEN_VISION, deepstack_visual_indexes=[0])),
        weight_prefix="model.language_model.",
    ),  # fmt: skip
    FamilyCase(
        "gpt_oss",
        "GptOssConfig",
        "GptOssForCausalLM",
        dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=8),
    ),  # fmt: skip
    FamilyCase("gemma2", "Gemma2Config", "Gemma2ForCausalLM", dict(sliding_window=8), norm_identity=0.0),
    FamilyCase(
        "gemma3_text", "Gemma3TextConfig", "Gemma3ForCausalLM", dict(sliding_window=8), norm_identity=0.0
    ),
    FamilyCase(
        "gemma3_text_softcap",
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        dict(sliding_window=8, final_logit_softcapping=30.0),
        norm_identity=0.0,
    ),  # fmt: skip
    FamilyCase(
        "gemma3",
        "Gemma3Config",
        "Gemma3ForConditionalGeneration",
        dict(sliding_window=8),
        dict(vision_config=dict(_SIGLIP, image_size=28, patch_size=14), mm_tokens_per_image=4),
        norm_identity=0.0,
        weight_prefix="language_model.model.",
    ),  # fmt: skip  (Gemma 3's hub layout)
    FamilyCase("gemma4_text", "Gemma4TextConfig", "Gemma4ForCausalLM", _GEMMA4),
    FamilyCase(
        "gemma4",
        "Gemma4Config",
        "Gemma4ForConditionalGeneration",
        dict(_GEMMA4, final_logit_softcapping=30.0),
        dict(vision_config=dict(_SIGLIP, head_dim=16, num_key_value_heads=2), audio_config=None),
        weight_prefix="model.language_model.",
    ),  # fmt: skip
)
BY_NAME = {c.name: c for c in CASES}

LOGIT_SCALE = 20.0
"""The LM head is multiplied by this after the random init, so logits are tens."""


def build_family_model(case: FamilyCase, out_dir: Path, tokenizer_dir: Path, *, seed: int = 0) -> Path:
    """Save ``case``'s tiny random model into ``out_dir`` with the tokenizer files of ``tokenizer_dir``."""
    import torch
    import transformers

    base = json.loads((tokenizer_dir / "config.json").read_text())
    ids = {k: base[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    text = dict(_TEXT, vocab_size=base["vocab_size"], **ids, **case.text)
    if case.name.startswith("gemma4"):
        text["vocab_size_per_layer_input"] = base["vocab_size"]
    config_cls = getattr(transformers, case.config)
    config = (
        config_cls(text_config=text, **case.wrapper, **ids)
        if case.wrapper is not None
        else config_cls(**text)
    )
    state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        model = getattr(transformers, case.model)(config).eval()
        with torch.no_grad():
            norm = model.get_decoder().norm.weight
            norm.copy_(case.norm_identity + 0.5 * torch.randn_like(norm))
            head = model.get_output_embeddings().weight
            head.mul_(LOGIT_SCALE / max(float(head.std()) * HIDDEN**0.5, 1e-6))
    finally:
        torch.random.set_rng_state(state)
    model.save_pretrained(out_dir, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
                 "chat_template.jinja"):  # fmt: skip
        if (tokenizer_dir / name).is_file():
            shutil.copy(tokenizer_dir / name, out_dir / name)
    forced = next((cls for prefix, cls in FORCED_TOKENIZERS.items() if case.name.startswith(prefix)), None)
    if forced is not None:
        _as_forced_tokenizer(out_dir / "tokenizer.json", forced)
    return out_dir


FORCED_TOKENIZERS = {"qwen2": "Qwen2Tokenizer", "qwen3_5": "Qwen3_5Tokenizer"}
"""Families whose tokenizer class transformers 5 picks by ``model_type``, whatever the files say."""


def _as_forced_tokenizer(path: Path, class_name: str) -> None:
    """Give ``tokenizer.json`` the normalizer and pre-tokenizer of the class transformers forces.

    transformers loads a Qwen2 or Qwen3.5 checkpoint's tokenizer with its own class, keeping only
    the vocabulary and merges; with these two parts in ``tokenizer.json`` too, the ``tokenizers``
    library (hsgen's renderer) and that class agree token for token, as they do for the released
    tokenizers of those families.
    """
    import transformers
    from tokenizers import Tokenizer

    forced = getattr(transformers, class_name)()._tokenizer
    tok = Tokenizer.from_file(str(path))
    tok.normalizer = forced.normalizer
    tok.pre_tokenizer = forced.pre_tokenizer
    tok.save(str(path))


def family_dirs(root: Path, tokenizer_dir: Path) -> Callable[[str], Path]:
    """A builder that saves each case once under ``root`` and then returns its directory."""
    built: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in built:
            built[name] = build_family_model(BY_NAME[name], root / name, tokenizer_dir)
        return built[name]

    return get
