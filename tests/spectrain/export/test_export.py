"""Exports reload with vLLM's weight names, shapes, dtypes and config fields
(shared/reference/speculators-checkpoint-format.md)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from spectrain.export.write import ADAPTERS, ExportError, export_draft
from spectrain.models import build_draft, get_config_class
from spectrain.models.verifier import VerifierHeads

H, HEADS, KV, HD, INTER = 64, 4, 2, 16, 128


@pytest.fixture(scope="module")
def heads(tiny_model_dir):
    return VerifierHeads.load(tiny_model_dir)


def _load(out):
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        weights = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    return weights, json.loads((out / "config.json").read_text())


def _layer_names(i: int, qk_norm: bool) -> set[str]:
    names = {f"layers.{i}.self_attn.{p}_proj.weight" for p in "qkvo"}
    names |= {f"layers.{i}.mlp.{p}_proj.weight" for p in ("gate", "up", "down")}
    names |= {f"layers.{i}.input_layernorm.weight", f"layers.{i}.post_attention_layernorm.weight"}
    if qk_norm:
        names |= {f"layers.{i}.self_attn.q_norm.weight", f"layers.{i}.self_attn.k_norm.weight"}
    return names


def _check_common(cfg, algorithm, tokens, heads):
    from transformers import AutoConfig

    assert cfg["speculators_model_type"] == algorithm
    spec = cfg["speculators_config"]
    assert spec["algorithm"] == algorithm and spec["default_proposal_method"] == "greedy"
    assert spec["proposal_methods"] == [
        {
            "proposal_type": "greedy",
            "speculative_tokens": tokens,
            "verifier_accept_k": 1,
            "accept_tolerance": 0.0,
        }
    ]
    assert spec["verifier"] == {"name_or_path": "Qwen/Qwen3-8B", "architectures": ["Qwen3ForCausalLM"]}
    assert cfg["target_hidden_size"] is None
    layer = dict(cfg["transformer_layer_config"])
    hf = AutoConfig.for_model(**layer)  # a config transformers (and so vLLM) can build
    assert hf.model_type == layer["model_type"]
    assert (hf.hidden_size, hf.num_attention_heads, hf.num_key_value_heads, hf.head_dim) == (H, HEADS, KV, HD)
    assert hf.intermediate_size == INTER and hf.vocab_size == heads.vocab_size
    assert layer["rms_norm_eps"] == heads.info.rms_norm_eps


def test_dflash_export(heads, tmp_path):
    m = build_draft(get_config_class("dflash")(aux_layer_ids=(1, 2, 3), num_layers=2, block_size=8), heads)
    out = export_draft(m, tmp_path / "d", verifier_name="Qwen/Qwen3-8B", architectures=["Qwen3ForCausalLM"])
    w, cfg = _load(out)
    want = {"fc.weight", "hidden_norm.weight", "norm.weight"} | _layer_names(0, True) | _layer_names(1, True)
    assert set(w) == want  # embed_tokens / lm_head shared from the target; no d2t/t2d at full vocabulary
    assert all(t.dtype == torch.bfloat16 for t in w.values())
    assert w["fc.weight"].shape == (H, 3 * H)
    assert w["layers.0.self_attn.q_proj.weight"].shape == (HEADS * HD, H)
    assert w["layers.0.self_attn.k_proj.weight"].shape == (KV * HD, H)
    assert w["layers.1.self_attn.q_norm.weight"].shape == (HD,)
    assert w["layers.0.mlp.down_proj.weight"].shape == (H, INTER)
    assert torch.equal(w["fc.weight"], m.fc.weight.detach().to(torch.bfloat16))
    _check_common(cfg, "dflash", 7, heads)
    assert cfg["architectures"] == ["DFlashDraftModel"]
    assert cfg["aux_hidden_state_layer_ids"] == [1, 2, 3]
    assert cfg["mask_token_id"] == heads.vocab_size - 1 and cfg["block_size"] == 8
    assert cfg["sample_from_anchor"] is False
    assert cfg.get("sliding_window_non_causal", True) is True
    assert cfg["draft_vocab_size"] == heads.vocab_size
    assert cfg["transformer_layer_config"]["model_type"] == "qwen3"
    assert cfg["transformer_layer_config"]["num_hidden_layers"] == 2


def test_dflash_reduced_vocab_export(heads, tmp_path):
    m = build_draft(get_config_class("dflash")(aux_layer_ids=(1, 2, 3), num_layers=1, block_size=4,
                                               draft_vocab_size=100), heads)  # fmt: skip
    counts = torch.zeros(heads.vocab_size)
    counts[500:600] = 1
    m.prepare(counts)
    out = export_draft(m, tmp_path / "r", verifier_name="Qwen/Qwen3-8B", architectures=["Qwen3ForCausalLM"])
    w, cfg = _load(out)
    assert {"d2t", "t2d", "lm_head.weight"} <= set(w)
    assert w["d2t"].dtype == torch.int64 and w["d2t"].shape == (100,)
    assert w["t2d"].dtype == torch.bool and w["t2d"].shape == (heads.vocab_size,)
    assert (torch.arange(100) + w["d2t"]).tolist() == list(range(500, 600))
    assert torch.equal(w["lm_head.weight"], heads.lm_head[500:600].to(torch.bfloat16))
    assert cfg["draft_vocab_size"] == 100


def test_eagle3_export(heads, tmp_path):
    m = build_draft(
        get_config_class("eagle3")(aux_layer_ids=(1, 2, 3), draft_vocab_size=256, ttt_steps=3), heads
    )
    counts = torch.arange(heads.vocab_size, dtype=torch.float64)  # the highest ids are the most frequent
    m.prepare(counts)
    out = export_draft(m, tmp_path / "e", verifier_name="Qwen/Qwen3-8B", architectures=["Qwen3ForCausalLM"])
    w, cfg = _load(out)
    want = {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d", "layers.0.hidden_norm.weight"}
    want |= _layer_names(0, False)
    assert set(w) == want
    assert w["fc.weight"].shape == (H, 3 * H)
    assert w["layers.0.self_attn.q_proj.weight"].shape == (HEADS * HD, 2 * H)
    assert w["layers.0.self_attn.k_proj.weight"].shape == (KV * HD, 2 * H)
    assert w["layers.0.self_attn.o_proj.weight"].shape == (H, HEADS * HD)
    assert w["lm_head.weight"].shape == (256, H) and w["lm_head.weight"].dtype == torch.bfloat16
    assert w["d2t"].dtype == torch.int64 and w["t2d"].dtype == torch.bool
    target_ids = torch.arange(256) + w["d2t"]
    assert target_ids.tolist() == list(range(heads.vocab_size - 256, heads.vocab_size))
    assert w["t2d"].sum() == 256 and w["t2d"][target_ids].all()
    _check_common(cfg, "eagle3", 3, heads)
    assert cfg["transformer_layer_config"]["model_type"] == "llama"
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
    assert cfg["draft_vocab_size"] == 256
    assert cfg["norm_before_residual"] is True and cfg["norm_before_fc"] is False


def test_adapter_rejects_foreign_names():
    with pytest.raises(ExportError, match="no vLLM name"):
        ADAPTERS["eagle3"].convert(
            {"fc.weight": torch.zeros(1), "layers.1.mlp.up_proj.weight": torch.zeros(1)}, "eagle3"
        )
    with pytest.raises(ExportError, match="lacks"):
        ADAPTERS["dflash"].convert({"module.fc.weight": torch.zeros(1)}, "dflash")
    got = ADAPTERS["dflash"].convert(
        {"module.fc.weight": torch.zeros(2), "_orig_mod.hidden_norm.weight": torch.ones(2),
         "norm.weight": torch.ones(2), "layers.0.self_attn.q_proj.weight": torch.ones(2)}, "dflash")  # fmt: skip
    assert set(got) == {"fc.weight", "hidden_norm.weight", "norm.weight", "layers.0.self_attn.q_proj.weight"}
