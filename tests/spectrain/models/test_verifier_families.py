"""The family matrix, differential: :class:`VerifierHeads` (the training targets, ``spectrain
eval``'s draft heads) against transformers' own forward of a tiny random model per family.

vLLM's layer id ``L`` (the last decoder layer's output, before the final norm) is read with a
hook; ``heads.logits`` of it must equal the model's own logits: final-norm offset (``weight`` vs
``1 + weight``), ``final_logit_softcapping``, tied or untied head, and a wrapper's weights under
``model.language_model.*`` included.
"""

from __future__ import annotations

import json

import pytest
import torch

from _families import CASES, LOGIT_SCALE
from spectrain.models.families import FAMILIES, family_of
from spectrain.models.verifier import VerifierError, VerifierHeads

NAMES = [c.name for c in CASES]
IDS = torch.tensor([[1, 5, 9, 300, 7, 2, 44, 45, 46, 47, 48, 100]])


def _model_logits(path, dtype):
    """The model's own logits and its last decoder layer's output for ``IDS``."""
    from hsgen.hf.causal_lm import load_causal_lm

    model = load_causal_lm(path, dtype).eval()
    captured = {}
    model.get_decoder().layers[-1].register_forward_hook(
        lambda m, i, o: captured.__setitem__("h", o[0] if isinstance(o, tuple) else o)
    )
    with torch.no_grad():
        out = model(input_ids=IDS, use_cache=False)
    return out.logits[0], captured["h"][0], model


def _rel(got, ref):
    return float((got.float() - ref.float()).abs().max() / ref.float().abs().max())


@pytest.mark.parametrize("name", NAMES)
def test_heads_reproduce_the_models_logits(family_model, name):
    torch.set_num_threads(1)
    path = family_model(name)
    ref, h_last, model = _model_logits(path, torch.float32)
    assert float(ref.abs().max()) > LOGIT_SCALE / 4, "the logits must have a real model's size"
    heads = VerifierHeads.load(path)
    got = heads.logits(h_last)
    assert _rel(got, ref) < 1e-4, (name, _rel(got, ref))
    # rows (the draft vocabulary's subset) equal the same columns
    rows = torch.tensor([3, 0, 17, heads.vocab_size - 1])
    assert torch.allclose(heads.logits(h_last, rows), got[:, rows], rtol=1e-6, atol=1e-5)
    cfg = json.loads((path / "config.json").read_text())
    text = cfg.get("text_config") or cfg
    if text.get("final_logit_softcapping"):
        cap = float(text["final_logit_softcapping"])
        assert heads.softcap == cap and float(got.abs().max()) < cap
    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    assert (heads.lm_head is heads.embed_tokens) == tied


@pytest.mark.parametrize("name", ["llama", "qwen3_5", "gemma3_text_softcap", "gemma4", "gpt_oss"])
def test_heads_in_bf16_stay_close(family_model, name):
    """bf16 heads on the bf16 model's states: within bf16 rounding of the bf16 model's logits."""
    torch.set_num_threads(1)
    path = family_model(name)
    ref, h_last, _ = _model_logits(path, torch.bfloat16)
    heads = VerifierHeads.load(path, dtype=torch.bfloat16)
    got = heads.logits(h_last)
    assert got.dtype == torch.bfloat16
    assert _rel(got, ref) < 2e-2, (name, _rel(got, ref))
    agree = (got.float().argmax(-1) == ref.float().argmax(-1)).float().mean()
    assert agree >= 0.9


@pytest.mark.parametrize("name", NAMES)
def test_heads_read_the_language_models_tensors(family_model, name):
    """The three tensors are the language model's, never a tower's, whatever the layout."""
    from safetensors import safe_open

    from _families import BY_NAME

    path = family_model(name)
    heads = VerifierHeads.load(path)
    prefix = BY_NAME[name].weight_prefix
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        assert torch.equal(heads.embed_tokens, f.get_tensor(prefix + "embed_tokens.weight"))
        assert torch.equal(heads.norm_weight, f.get_tensor(prefix + "norm.weight"))
    assert heads.info.model_type in {t for fam in FAMILIES for t in fam.model_types}
    assert heads.norm_offset == family_of(heads.info.model_type).norm_offset


def test_an_unknown_family_is_refused_in_one_line(family_model, tmp_path):
    import shutil

    src = family_model("llama")
    for f in src.iterdir():
        shutil.copy(f, tmp_path / f.name)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["model_type"] = "falcon_h1"
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(VerifierError) as e:
        VerifierHeads.load(tmp_path)
    msg = str(e.value)
    assert "\n" not in msg and "config.json" in msg and "'falcon_h1'" in msg and "gemma4_text" in msg


@pytest.mark.parametrize("chunk_rows", [3, None])
def test_soft_targets_follow_the_softcap(chunk_rows):
    """The soft loss's verifier side is ``cap * tanh(logits / cap)``, as the verifier's forward,
    both when formed chunk by chunk and when computed once (Eagle3's :func:`verifier_targets`)."""
    from spectrain.models.vocab_loss import verifier_targets, vocab_loss

    g = torch.Generator().manual_seed(0)
    n, h, v, cap = 7, 16, 50, 30.0
    hidden = torch.randn(n, h, generator=g, requires_grad=True)
    head = torch.randn(v, h, generator=g) * 3
    target_hidden = torch.randn(n, h, generator=g) * 4  # logits up to ~80: the cap matters
    raw = target_hidden @ head.T
    assert float(raw.abs().max()) > cap
    p = torch.softmax(torch.tanh(raw / cap) * cap, -1)
    expected = (p * (p.log() - torch.log_softmax(hidden @ head.T, -1))).sum(-1)
    loss, _, _ = vocab_loss(
        hidden, head, target_hidden, head, "soft", target_softcap=cap, chunk_rows=chunk_rows
    )
    assert torch.allclose(loss, expected, atol=1e-5)
    uncapped, _, _ = vocab_loss(hidden, head, target_hidden, head, "soft", chunk_rows=chunk_rows)
    assert not torch.allclose(uncapped, expected, atol=1e-3)
    targets = verifier_targets(target_hidden, head, "soft", softcap=cap)
    loss2, _, _ = vocab_loss(hidden, head, mode="soft", targets=targets, chunk_rows=chunk_rows)
    assert torch.allclose(loss2, expected, atol=1e-5)
    loss.sum().backward()
    grad = hidden.grad.clone()
    hidden.grad = None
    expected.sum().backward()
    assert torch.allclose(grad, hidden.grad, atol=1e-5)


@pytest.mark.parametrize("name", ["llama", "qwen3_5", "gemma2", "gemma3", "gemma4_text", "gemma4"])
def test_the_draft_sees_the_embedding_vllm_feeds_it(family_model, name):
    """The draft's token embedding is the verifier's ``embed_tokens`` row, unscaled, even for
    Gemma (whose own forward multiplies it by ``sqrt(hidden_size)``).

    The vLLM behaviour matched (vLLM main, read 2026-12):
    ``vllm/v1/spec_decode/llm_base_proposer.py`` ``_maybe_share_embeddings`` replaces the draft's
    ``model.embed_tokens`` with the target's ``model.embed_tokens`` module, a plain
    ``VocabParallelEmbedding``; Gemma's ``normalizer`` is applied outside it, in
    ``vllm/model_executor/models/gemma4.py`` ``Gemma4SelfDecoderLayers.embed_input_ids``
    (``embed_tokens(ids) * normalizer``), which the draft never calls. The drafts embed with
    ``embed_tokens(input_ids)`` alone: ``vllm/model_executor/models/qwen3_dflash.py``
    ``DFlashQwen3Model.embed_input_ids`` (the DFlash proposer, ``vllm/v1/spec_decode/dflash.py``,
    passes ``inputs_embeds=None``) and ``vllm/model_executor/models/llama_eagle3.py``
    ``LlamaModel.embed_input_ids`` (Eagle3).
    """
    from hsgen.hf.causal_lm import load_causal_lm

    path = family_model(name)
    heads = VerifierHeads.load(path)
    model = load_causal_lm(path, torch.float32).eval()
    table = model.get_input_embeddings().weight
    ids = IDS[0]
    assert torch.equal(heads.embed(ids), table[ids])
    family = family_of(heads.info.model_type)
    with torch.no_grad():
        own = model.get_input_embeddings()(ids)  # what the verifier's layer 0 sees (vLLM id 0)
    scale = heads.info.hidden_size**0.5 if family.embed_scale else 1.0
    assert torch.allclose(own, heads.embed(ids) * scale, rtol=1e-5, atol=1e-6)
    assert family.embed_scale == name.startswith("gemma")
