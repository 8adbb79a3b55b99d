"""Verifier heads: only embeddings, final norm and LM head are read; sharded and tied layouts."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from spectrain.models.verifier import VerifierError, VerifierHeads, read_verifier_info


def _tensors(model_dir: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118


def test_heads_match_transformers_logits(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    heads = VerifierHeads.load(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).eval()
    captured = {}
    model.model.layers[-1].register_forward_hook(
        lambda m, i, o: captured.__setitem__("h", o[0] if isinstance(o, tuple) else o)
    )
    ids = torch.tensor([[1, 5, 9, 300, 7, 2]])
    with torch.no_grad():
        out = model(ids)
    ref = out.logits[0]
    got = heads.logits(captured["h"][0])
    assert torch.allclose(got, ref, atol=1e-4), (got - ref).abs().max()
    assert torch.equal(heads.embed(ids[0]), model.model.embed_tokens(ids[0]))
    assert not heads.lm_head.requires_grad
    info = heads.info
    assert (info.hidden_size, info.num_hidden_layers, info.vocab_size) == (64, 4, heads.vocab_size)


def test_sharded_index_reads_only_needed_files(tiny_model_dir, tmp_path):
    tensors = _tensors(tiny_model_dir)
    heads_names = {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}
    shard_a = {k: v for k, v in tensors.items() if k in heads_names}
    shard_b = {k: v for k, v in tensors.items() if k not in heads_names}
    shutil.copy(tiny_model_dir / "config.json", tmp_path / "config.json")
    save_file(shard_a, str(tmp_path / "model-00001-of-00003.safetensors"))
    save_file(shard_b, str(tmp_path / "model-00002-of-00003.safetensors"))
    weight_map = {k: "model-00001-of-00003.safetensors" for k in shard_a}
    weight_map |= {k: "model-00002-of-00003.safetensors" for k in shard_b}
    weight_map["model.layers.99.mlp.up_proj.weight"] = (
        "model-00003-of-00003.safetensors"  # never read: absent file
    )
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map})
    )
    heads = VerifierHeads.load(tmp_path)
    ref = VerifierHeads.load(tiny_model_dir)
    assert torch.equal(heads.lm_head, ref.lm_head) and torch.equal(heads.norm_weight, ref.norm_weight)


def test_tied_embeddings(tiny_model_dir, tmp_path):
    tensors = _tensors(tiny_model_dir)
    tensors.pop("lm_head.weight")
    cfg = json.loads((tiny_model_dir / "config.json").read_text())
    cfg["tie_word_embeddings"] = True
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    save_file(tensors, str(tmp_path / "model.safetensors"))
    heads = VerifierHeads.load(tmp_path)
    assert heads.lm_head is heads.embed_tokens
    h = torch.randn(3, 64)
    assert torch.allclose(heads.logits(h), heads.norm(h) @ tensors["model.embed_tokens.weight"].T)


def test_clear_errors(tmp_path, tiny_model_dir):
    with pytest.raises(VerifierError, match="config.json"):
        read_verifier_info(tmp_path)
    (tmp_path / "config.json").write_text('{"hidden_size": 8,')
    with pytest.raises(VerifierError, match=r"config.json:1"):
        read_verifier_info(tmp_path)
    shutil.copy(tiny_model_dir / "config.json", tmp_path / "config.json")
    with pytest.raises(VerifierError, match="no model.safetensors"):
        VerifierHeads.load(tmp_path)
    cfg = json.loads((tiny_model_dir / "config.json").read_text())
    del cfg["vocab_size"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(VerifierError, match="vocab_size"):
        read_verifier_info(tmp_path)
