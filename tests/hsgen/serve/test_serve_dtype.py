"""``hsgen serve --dtype auto`` resolves as vLLM does: a float32 checkpoint is served in bf16."""

from __future__ import annotations

import json

import pytest
import torch

from hsgen.serve.dtypes import checkpoint_dtype, resolve_auto_dtype


@pytest.mark.parametrize(
    "config,expected",
    [({"torch_dtype": "float32"}, "bfloat16"), ({"dtype": "bfloat16"}, "bfloat16"), ({"torch_dtype": "float16"}, "float16"),
     ({}, "bfloat16"), ({"text_config": {"dtype": "float16"}}, "float16")],
)  # fmt: skip
def test_auto_on_cpu(tmp_path, config, expected):
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert resolve_auto_dtype(tmp_path, "cpu") == expected


def test_auto_on_a_gpu_without_bf16(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    for recorded in ("float32", "bfloat16"):
        (tmp_path / "config.json").write_text(json.dumps({"torch_dtype": recorded}))
        assert resolve_auto_dtype(tmp_path, "cuda:0") == "float16"
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    assert resolve_auto_dtype(tmp_path, "cuda") == "bfloat16"


def test_the_tiny_float32_model_is_served_in_bf16(tiny_model_dir):
    from hsgen.serve.hidden import load_model

    assert checkpoint_dtype(json.loads((tiny_model_dir / "config.json").read_text())) == "float32"
    assert load_model(str(tiny_model_dir)).dtype == torch.bfloat16
    assert load_model(str(tiny_model_dir), dtype="float32").dtype == torch.float32
