"""Read exported drafts (the format vLLM serves: ``config.json`` + ``model.safetensors``) back into
spectrain draft modules, whether spectrain or speculators wrote them.

Every field of ``config.json`` is either honoured or refused with a :class:`DraftLoadError`
naming the file and the field; nothing is silently ignored. Fields that do not change the
forward pass (versions, dtypes, ``auto_map``, initializer settings) are listed in
``_INERT`` and accepted. Weights the verifier owns (``embed_tokens.weight``, a DFlash
``lm_head.weight``, full-vocabulary ``d2t``/``t2d``) are accepted when they equal what the
verifier gives, refused otherwise.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from spectrain.models import DraftConfig, DraftModel, build_draft, get_config_class
from spectrain.models.common import draft_to_target_ids
from spectrain.models.verifier import VerifierHeads

log = logging.getLogger(__name__)

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"

_INERT = {"architectures", "auto_map", "dtype", "torch_dtype", "speculators_version", "transformers_version",
          "_name_or_path", "speculators_model_type", "speculators_config", "transformer_layer_config",
          "draft_vocab_size", "target_hidden_size", "tie_word_embeddings"}  # fmt: skip
_ALGORITHM_FIELDS = {
    "dflash": {"aux_hidden_state_layer_ids", "mask_token_id", "block_size", "sample_from_anchor",
               "sliding_window_non_causal"},
    "dspark": {"aux_hidden_state_layer_ids", "mask_token_id", "block_size", "sample_from_anchor",
               "sliding_window_non_causal", "markov_rank", "markov_head_type", "enable_confidence_head",
               "confidence_head_with_markov"},
    "eagle3": {"eagle_aux_hidden_state_layer_ids", "norm_before_residual", "norm_before_fc", "fc_norm",
               "norm_output", "embed_requires_grad"},
}  # fmt: skip
_LAYER_INERT = {"transformers_version", "use_cache", "initializer_range", "bos_token_id", "eos_token_id",
                "pad_token_id", "attention_dropout", "max_window_layers", "max_position_embeddings",
                "architectures", "dtype", "torch_dtype", "_name_or_path", "output_attentions",
                "output_hidden_states", "return_dict"}  # fmt: skip
_LAYER_CHECKED = {"model_type", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                  "head_dim", "intermediate_size", "vocab_size", "rms_norm_eps", "rope_theta", "rope_parameters",
                  "rope_scaling", "hidden_act", "attention_bias", "mlp_bias", "pretraining_tp",
                  "tie_word_embeddings", "layer_types", "sliding_window", "use_sliding_window"}  # fmt: skip
_LAYER_MODEL_TYPE = {"dflash": "qwen3", "dspark": "qwen3", "eagle3": "llama"}
ARCHITECTURE_FIELDS = ("aux_layer_ids", "num_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
                       "intermediate_size", "draft_vocab_size", "block_size", "mask_token_id", "block_attention",
                       "sliding_window", "norm_before_residual", "norm_before_fc", "norm_output",
                       "sample_from_anchor", "markov_rank", "markov_head_type", "enable_confidence_head",
                       "confidence_head_with_markov")  # fmt: skip
"""Draft options an exported draft fixes: ``--from-pretrained`` refuses different values."""


class DraftLoadError(ValueError):
    """An exported draft directory that cannot be loaded (names the file and the field)."""


def _need(cfg: Mapping[str, Any], key: str, where: str) -> Any:
    if cfg.get(key) is None:
        raise DraftLoadError(f"{where}: missing field {key!r}")
    return cfg[key]


def read_export_config(draft_dir: str | Path) -> dict[str, Any]:
    """``config.json`` of an exported draft (errors name the file and line)."""
    path = Path(draft_dir) / CONFIG_NAME
    if not path.is_file():
        raise DraftLoadError(f"{path}: not found (expected a directory written by `spectrain export`)")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise DraftLoadError(f"{path}:{e.lineno}: invalid JSON: {e.msg}") from None


def read_draft_algorithm(draft_dir: str | Path) -> str:
    """The algorithm (``speculators_model_type``) of an exported draft."""
    return str(
        _need(read_export_config(draft_dir), "speculators_model_type", str(Path(draft_dir) / CONFIG_NAME))
    )


def _close(a: float, b: float) -> bool:
    return math.isclose(float(a), float(b), rel_tol=1e-6)


def _check_layer_config(layer: Mapping[str, Any], algorithm: str, info: Any, where: str) -> int | None:
    """Refuse a ``transformer_layer_config`` the draft module cannot reproduce; returns the sliding window."""
    where = f"{where}: transformer_layer_config"
    unknown = sorted(set(layer) - _LAYER_INERT - _LAYER_CHECKED)
    if unknown:
        raise DraftLoadError(
            f"{where}: fields {unknown} are not understood; refusing rather than ignoring them"
        )
    model_type = layer.get("model_type")
    if model_type != _LAYER_MODEL_TYPE[algorithm]:
        raise DraftLoadError(f"{where}: model_type {model_type!r}; a {algorithm} draft here has "
                             f"{_LAYER_MODEL_TYPE[algorithm]!r} layers")  # fmt: skip
    if info is not None:
        for key, want in (("hidden_size", info.hidden_size), ("vocab_size", info.vocab_size)):
            if layer.get(key) is not None and int(layer[key]) != int(want):
                raise DraftLoadError(f"{where}: {key} {layer[key]} differs from the verifier's {want}")
        if layer.get("rms_norm_eps") is not None and not _close(layer["rms_norm_eps"], info.rms_norm_eps):
            raise DraftLoadError(f"{where}: rms_norm_eps {layer['rms_norm_eps']} differs from the verifier's "
                                 f"{info.rms_norm_eps}")  # fmt: skip
        rope = layer.get("rope_parameters") or {}
        theta = layer.get("rope_theta", rope.get("rope_theta"))
        if theta is not None and not _close(theta, info.rope_theta):
            raise DraftLoadError(f"{where}: rope_theta {theta} differs from the verifier's {info.rope_theta}")
    rope = layer.get("rope_parameters") or layer.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        raise DraftLoadError(
            f"{where}: rope type {rope.get('rope_type', rope.get('type'))!r} is not supported"
        )
    for key, want in (("hidden_act", "silu"), ("attention_bias", False), ("mlp_bias", False),
                      ("pretraining_tp", 1), ("tie_word_embeddings", False)):  # fmt: skip
        if key in layer and layer[key] is not None and layer[key] != want:
            raise DraftLoadError(f"{where}: {key} {layer[key]!r} is not supported (only {want!r})")
    types = list(layer.get("layer_types") or [])
    sliding = [t == "sliding_attention" for t in types]
    if any(t not in ("full_attention", "sliding_attention") for t in types):
        raise DraftLoadError(f"{where}: layer_types {types} hold an unknown attention type")
    if sliding and all(sliding):
        return int(_need(layer, "sliding_window", where))
    if any(sliding):
        raise DraftLoadError(f"{where}: layer_types {types} mix sliding and full attention; not supported")
    return None


def draft_config_from_export(
    cfg: Mapping[str, Any],
    vocab_size: int,
    where: str = CONFIG_NAME,
    *,
    verifier_info: Any = None,
    block_attention: str | None = None,
) -> tuple[DraftConfig, int]:
    """Rebuild the draft config of an exported draft from its ``config.json``.

    Args:
        verifier_info: the verifier's :class:`~spectrain.models.verifier.VerifierInfo`; when given,
            hidden size, vocabulary, norm epsilon and RoPE base must match it.
        block_attention: DFlash only: override what ``sliding_window_non_causal`` says
            (``bidirectional`` | ``causal``); None follows the config as vLLM serves it.

    Returns:
        ``(DraftConfig, num_speculative_tokens)``.
    """
    algorithm = _need(cfg, "speculators_model_type", where)
    if algorithm not in _ALGORITHM_FIELDS:
        raise DraftLoadError(f"{where}: speculators_model_type {algorithm!r} is not dflash, dspark or eagle3")
    unknown = sorted(set(cfg) - _INERT - _ALGORITHM_FIELDS[algorithm])
    if unknown:
        raise DraftLoadError(f"{where}: fields {unknown} are not understood for {algorithm}; refusing rather "
                             "than ignoring them")  # fmt: skip
    if cfg.get("tie_word_embeddings"):
        raise DraftLoadError(f"{where}: tie_word_embeddings true is not supported")
    layer = _need(cfg, "transformer_layer_config", where)
    spec = _need(cfg, "speculators_config", where)
    try:
        k = int(spec["proposal_methods"][0]["speculative_tokens"])
    except (KeyError, IndexError, TypeError, ValueError):
        raise DraftLoadError(
            f"{where}: speculators_config.proposal_methods[0].speculative_tokens is missing"
        ) from None
    window = _check_layer_config(layer, algorithm, verifier_info, where)
    target_hidden = cfg.get("target_hidden_size")
    if (
        verifier_info is not None
        and target_hidden is not None
        and int(target_hidden) != verifier_info.hidden_size
    ):
        raise DraftLoadError(f"{where}: target_hidden_size {target_hidden} differs from the verifier's "
                             f"hidden_size {verifier_info.hidden_size}")  # fmt: skip
    common = {
        "num_layers": int(_need(layer, "num_hidden_layers", f"{where}: transformer_layer_config")),
        "num_attention_heads": layer.get("num_attention_heads"),
        "num_key_value_heads": layer.get("num_key_value_heads"),
        "head_dim": layer.get("head_dim"),
        "intermediate_size": layer.get("intermediate_size"),
        "sliding_window": window,
    }
    draft_vocab = cfg.get("draft_vocab_size")
    if algorithm in ("dflash", "dspark"):
        read = _dflash_fields if algorithm == "dflash" else _dspark_fields
        fields = read(cfg, k, window, where, block_attention)
        fields["draft_vocab_size"] = (
            int(draft_vocab) if draft_vocab and int(draft_vocab) < vocab_size else None
        )
    else:
        if cfg.get("fc_norm"):
            raise DraftLoadError(f"{where}: fc_norm (one RMSNorm per auxiliary layer) is not supported")
        fields = {
            "aux_layer_ids": tuple(_need(cfg, "eagle_aux_hidden_state_layer_ids", where)),
            "draft_vocab_size": int(draft_vocab) if draft_vocab else None,
            "ttt_steps": k,
            "norm_before_residual": bool(cfg.get("norm_before_residual", True)),
            "norm_before_fc": bool(cfg.get("norm_before_fc", False)),
            "norm_output": bool(cfg.get("norm_output", False)),
        }
    try:
        return get_config_class(algorithm)(**common, **fields), k
    except (TypeError, ValueError) as e:
        raise DraftLoadError(f"{where}: {e}") from None


def _dflash_fields(cfg: Mapping[str, Any], k: int, window: int | None, where: str,
                   block_attention: str | None) -> dict[str, Any]:  # fmt: skip
    block = int(cfg.get("block_size") or k + 1)
    if cfg.get("sample_from_anchor"):
        raise DraftLoadError(f"{where}: sample_from_anchor true is not supported (vLLM rejects it too)")
    if block != k + 1:
        raise DraftLoadError(
            f"{where}: block_size {block} but speculative_tokens {k} (expected block_size - 1)"
        )
    non_causal = cfg.get("sliding_window_non_causal")
    served = "causal" if non_causal is False else "bidirectional"
    if non_causal is False and window is None and "speculators_version" in cfg and block_attention is None:
        log.warning(
            "%s: sliding_window_non_causal is false on full-attention layers: speculators trained these layers "
            "bidirectionally inside the block, but vLLM serves them causally. Evaluating as vLLM serves it "
            "(causal); pass block_attention='bidirectional' (--block-attention bidirectional) for the "
            "trainer's own forward, or set the field to true in config.json to serve it as trained.",
            where,
        )
    return {
        "aux_layer_ids": tuple(_need(cfg, "aux_hidden_state_layer_ids", where)),
        "block_size": block,
        "mask_token_id": int(_need(cfg, "mask_token_id", where)),
        "block_attention": block_attention or served,
    }


def _dspark_fields(cfg: Mapping[str, Any], k: int, window: int | None, where: str,
                   block_attention: str | None) -> dict[str, Any]:  # fmt: skip
    """DSpark's fields as vLLM 0.32 reads them: ``sample_from_anchor`` and the confidence flags false
    when absent, ``markov_rank`` required; full-attention layers bidirectional and sliding ones
    causal (vLLM ignores ``sliding_window_non_causal`` for dspark)."""
    anchor_first = bool(cfg.get("sample_from_anchor", False))
    block = int(cfg.get("block_size") or (k if anchor_first else k + 1))
    most = block if anchor_first else block - 1
    if not 0 < k <= most:
        raise DraftLoadError(f"{where}: speculative_tokens {k} but a block of {block} proposes at most {most} "
                             f"(sample_from_anchor {str(anchor_first).lower()})")  # fmt: skip
    return {
        "aux_layer_ids": tuple(_need(cfg, "aux_hidden_state_layer_ids", where)),
        "block_size": block,
        "mask_token_id": int(_need(cfg, "mask_token_id", where)),
        "block_attention": block_attention or ("causal" if window is not None else "bidirectional"),
        "sample_from_anchor": anchor_first,
        "markov_rank": int(_need(cfg, "markov_rank", where)),
        "markov_head_type": str(cfg.get("markov_head_type") or "vanilla"),
        "enable_confidence_head": bool(cfg.get("enable_confidence_head", False)),
        "confidence_head_with_markov": bool(cfg.get("confidence_head_with_markov", False)),
    }


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal up to the rounding of the lower-precision of the two."""
    dtype = a.dtype if torch.finfo(a.dtype).bits <= torch.finfo(b.dtype).bits else b.dtype
    return a.shape == b.shape and torch.equal(a.to(dtype), b.to(dtype))


def load_draft_weights(model: DraftModel, weights: dict[str, torch.Tensor], where: str) -> None:
    """Load exported ``weights`` into ``model``; verifier-owned tensors must match the verifier's."""
    weights = dict(weights)
    state = model.state_dict()
    heads = model.verifier
    embed = weights.pop("embed_tokens.weight", None)
    if embed is not None and not _same(embed.cpu(), heads.embed_tokens.detach().cpu()):
        raise DraftLoadError(f"{where}: embed_tokens.weight differs from the verifier's; a draft with its own "
                                 "embeddings is not supported")  # fmt: skip
    if (
        model.cfg.algorithm in ("dflash", "dspark")
        and "lm_head.weight" in weights
        and "lm_head.weight" not in state
    ):
        d2t = weights.get("d2t", state.get("d2t"))
        rows = (
            heads.lm_head if d2t is None else heads.lm_head.index_select(0, draft_to_target_ids(d2t.long()))
        )
        if not _same(weights.pop("lm_head.weight").cpu(), rows.detach().cpu()):
            raise DraftLoadError(f"{where}: lm_head.weight differs from the verifier's rows; a DFlash draft with "
                                 "its own head is not supported")  # fmt: skip
    vocab = heads.vocab_size
    for name in ("d2t", "t2d"):
        if name in weights and name not in state:  # a full-vocabulary map: it must be the identity
            t = weights.pop(name)
            identity = not t.any() if name == "d2t" else bool(t.all())
            if not identity or t.shape[0] != vocab:
                raise DraftLoadError(f"{where}: {name} of a full-vocabulary draft is not the identity")
    if "d2t" in state and "d2t" not in weights and "t2d" not in weights and state["d2t"].shape[0] == vocab:
        weights["d2t"] = torch.zeros(vocab, dtype=torch.int64)  # full vocabulary, maps omitted
        weights["t2d"] = torch.ones(vocab, dtype=torch.bool)
    missing = sorted(set(state) - set(weights))
    unexpected = sorted(set(weights) - set(state))
    if missing or unexpected:
        raise DraftLoadError(f"{where}: missing weights {missing}, unexpected weights {unexpected}")
    for name, t in weights.items():
        if tuple(t.shape) != tuple(state[name].shape):
            raise DraftLoadError(
                f"{where}: {name} has shape {tuple(t.shape)}, the config implies {tuple(state[name].shape)}"
            )
    model.load_state_dict({n: t.to(state[n].dtype) for n, t in weights.items()})


def build_exported_draft(
    draft_dir: str | Path,
    heads: VerifierHeads,
    *,
    block_attention: str | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> tuple[DraftModel, int]:
    """Build the draft of an exported directory on ``heads`` and load its weights.

    Args:
        overrides: training options to set on the rebuilt config (``--from-pretrained``); an
            option of :data:`ARCHITECTURE_FIELDS` must equal the draft's own value.

    Returns:
        ``(model, num_speculative_tokens)``.
    """
    from safetensors.torch import load_file

    draft_dir = Path(draft_dir)
    cfg_path, weights_path = draft_dir / CONFIG_NAME, draft_dir / WEIGHTS_NAME
    for p in (cfg_path, weights_path):
        if not p.is_file():
            raise DraftLoadError(f"{p}: not found (expected a directory written by `spectrain export`)")
    raw = read_export_config(draft_dir)
    cfg, k = draft_config_from_export(raw, heads.vocab_size, str(cfg_path), verifier_info=heads.info,
                                      block_attention=block_attention)  # fmt: skip
    if overrides:
        cfg = _apply_overrides(cfg, overrides, str(draft_dir))
    model = build_draft(cfg, heads)
    load_draft_weights(model, load_file(str(weights_path)), str(weights_path))
    return model, k


def _apply_overrides(cfg: DraftConfig, overrides: Mapping[str, Any], where: str) -> DraftConfig:
    merged = cfg.to_dict()
    for key, value in overrides.items():
        if key not in merged:
            raise DraftLoadError(f"{where}: unknown {cfg.algorithm} option {key!r}")
        have = merged[key]
        norm = list(value) if isinstance(value, tuple | list) else value
        if key == "aux_layer_ids" and norm is not None:
            norm = sorted(norm)
        if key in ARCHITECTURE_FIELDS and norm is not None and norm != have:
            raise DraftLoadError(f"--from-pretrained {where}: option {key}={value!r} conflicts with the draft's "
                                 f"{have!r}")  # fmt: skip
        merged[key] = value if norm is not None or key not in ARCHITECTURE_FIELDS else have
    try:
        return type(cfg).from_dict(merged, where=where)
    except (TypeError, ValueError) as e:
        raise DraftLoadError(f"{where}: {e}") from None
