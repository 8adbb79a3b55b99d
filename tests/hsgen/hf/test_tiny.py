"""The built-in tiny verifier builds offline, deterministically, and loads like any HF model."""

from __future__ import annotations

import json

import pytest

from hsgen.hf.tiny import TinyModelSpec, ensure_tiny_model
from hsgen.inputs.sample_data import iter_sample_chats, sample_chats_path

pytest.importorskip("transformers")


def test_sample_chats_are_well_formed():
    rows = list(iter_sample_chats())
    assert len(rows) > 500
    ids = [r["id"] for r in rows]
    assert len(set(ids)) == len(ids)
    for row in rows:
        roles = [m["role"] for m in row["messages"]]
        assert "assistant" in roles and "user" in roles
        assert roles[-1] == "assistant"
    assert sample_chats_path().read_text().count("\n") == len(rows)


def test_tiny_model_is_deterministic_and_loads(tmp_path, tiny_model_dir):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    spec = TinyModelSpec(num_hidden_layers=2, tokenizer_vocab_size=600)
    a = ensure_tiny_model(tmp_path / "a", spec)
    b = ensure_tiny_model(tmp_path / "b", spec)
    assert (a / "tokenizer.json").read_bytes() == (b / "tokenizer.json").read_bytes()
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    assert ensure_tiny_model(tmp_path / "a", spec) == a  # cached, not rebuilt

    config = json.loads((tiny_model_dir / "config.json").read_text())
    assert config["model_type"] == "qwen3"
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, local_files_only=True)
    assert config["vocab_size"] > len(tokenizer), "an unused id must remain for DFlash's mask token"
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What does json.dumps do?"}], tokenize=False, add_generation_prompt=True
    )
    assert text == "<|im_start|>user\nWhat does json.dumps do?<|im_end|>\n<|im_start|>assistant\n"
    ids = tokenizer(text)["input_ids"]
    assert tokenizer.decode(ids) == text
    with torch.no_grad():
        out = model(torch.tensor([ids]), output_hidden_states=True)
    assert len(out.hidden_states) == config["num_hidden_layers"] + 1
    assert out.logits.shape == (1, len(ids), config["vocab_size"])
    # The default model is briefly pretrained: its next-token distributions are far from uniform.
    entropy = -(out.logits.softmax(-1) * out.logits.log_softmax(-1)).sum(-1).mean()
    assert entropy < 0.7 * torch.log(torch.tensor(float(config["vocab_size"])))
