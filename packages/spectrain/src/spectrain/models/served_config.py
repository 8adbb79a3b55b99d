"""The blocks of a draft's ``config.json`` that vLLM reads, common to every algorithm: the HF decoder
config of the draft's layers and the ``speculators_config`` (docs/export.md)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def qwen3_layer_config(
    info: Any, hidden, layers, heads, kv_heads, head_dim, intermediate, model_type="qwen3"
) -> dict:
    """An HF decoder config (``transformer_layer_config``) for the draft's layers."""
    cfg = {
        "model_type": model_type,
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "intermediate_size": intermediate,
        "vocab_size": info.vocab_size,
        "rms_norm_eps": info.rms_norm_eps,
        "rope_theta": info.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": info.rope_theta},
        "max_position_embeddings": info.max_position_embeddings,
        "hidden_act": "silu",
        "attention_bias": False,
        "tie_word_embeddings": False,
    }
    if model_type == "qwen3":
        cfg["layer_types"] = ["full_attention"] * layers
        cfg["use_sliding_window"] = False
        cfg["sliding_window"] = None
    if model_type == "llama":
        cfg["mlp_bias"] = False
    return cfg


def speculators_config(algorithm: str, tokens: int, verifier_name: str, architectures: Sequence[str]) -> dict:
    """The ``speculators_config`` block vLLM reads (greedy proposals of ``tokens`` tokens)."""
    return {
        "algorithm": algorithm,
        "default_proposal_method": "greedy",
        "proposal_methods": [
            {
                "proposal_type": "greedy",
                "speculative_tokens": tokens,
                "verifier_accept_k": 1,
                "accept_tolerance": 0.0,
            }
        ],
        "verifier": {"name_or_path": verifier_name, "architectures": list(architectures)},
    }


__all__ = ["qwen3_layer_config", "speculators_config"]
