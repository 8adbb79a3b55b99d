"""Exported DFlash / DSpark / Eagle3 drafts: loading the vLLM format, exact speculative decoding, tau bounds."""

from __future__ import annotations

import json

import pytest
import torch

from spectrain.eval.decode import (
    DraftLoadError,
    EvalPrompt,
    evaluate,
    load_exported_draft,
    load_verifier,
    speculative_generate,
)
from spectrain.export.write import export_draft
from spectrain.models import DraftContext, build_draft, get_config_class
from spectrain.models.verifier import VerifierHeads

torch.set_num_threads(1)

DRAFTS = {
    "dflash": {"aux_layer_ids": (1, 2, 3), "num_layers": 1, "block_size": 5},
    "eagle3": {"aux_layer_ids": (1, 2, 3), "ttt_steps": 3, "draft_vocab_size": 512},
    "dspark": {
        "aux_layer_ids": (1, 2, 3),
        "num_layers": 1,
        "block_size": 4,
        "markov_rank": 16,
        "draft_vocab_size": 512,
    },
}
TOKENS = {"dflash": 4, "eagle3": 3, "dspark": 4}


def _random_draft(tiny_model_dir, algorithm: str, seed: int = 0):
    torch.manual_seed(seed)
    heads = VerifierHeads.load(tiny_model_dir)
    cfg = get_config_class(algorithm)(**DRAFTS[algorithm])
    model = build_draft(cfg, heads)
    counts = torch.arange(heads.vocab_size, 0, -1, dtype=torch.float64)  # a reduced vocabulary of low ids
    model.prepare(counts)
    with torch.no_grad():  # weights exactly representable in bf16, so the export round-trips bit for bit
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    return model.eval()


@pytest.fixture(scope="module", params=sorted(DRAFTS))
def exported(request, tiny_model_dir, tmp_path_factory):
    algorithm = request.param
    model = _random_draft(tiny_model_dir, algorithm)
    out = export_draft(model, tmp_path_factory.mktemp(algorithm) / "draft", verifier_name="tiny")
    return algorithm, model, out


@pytest.fixture(scope="module")
def prompts(tiny_model_dir) -> list[EvalPrompt]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    texts = ["def f(x):\n    return x +", "import json\n\n", "for i in range(10):\n"]
    return [EvalPrompt(f"p{i}", tuple(tok.encode(t)), "") for i, t in enumerate(texts)]


def test_loaded_draft_proposes_like_the_trained_module(exported, tiny_model_dir):
    algorithm, model, out = exported
    proposer = load_exported_draft(out, tiny_model_dir)
    assert proposer.algorithm == algorithm
    assert proposer.layer_ids == (1, 2, 3)
    assert proposer.num_speculative_tokens == TOKENS[algorithm]
    g = torch.Generator().manual_seed(1)
    for T in (1, 7):
        aux = torch.randn(T, 3, 64, generator=g)
        ids = torch.randint(0, 1000, (T + 1,), generator=g).tolist()
        k = proposer.num_speculative_tokens
        expected = model.propose(DraftContext(aux, ids), k)
        assert proposer.propose(ids, aux, k) == expected
        assert len(expected) == k


def test_random_draft_is_exact(exported, tiny_model_dir, prompts):
    algorithm, _, out = exported
    proposer = load_exported_draft(out, tiny_model_dir)
    verifier, _ = load_verifier(tiny_model_dir, proposer.layer_ids)
    report = evaluate(verifier, proposer, prompts, max_new_tokens=20)
    assert report.exact_match, report.mismatches
    assert 1.0 <= report.tau <= proposer.num_speculative_tokens + 1
    assert sum(report.accepted_histogram) == report.steps
    assert report.new_tokens == sum(r["new_tokens"] for r in report.per_prompt)
    assert len(report.acceptance_rate) == proposer.num_speculative_tokens
    assert all(0.0 <= r <= 1.0 for r in report.acceptance_rate + report.conditional_acceptance)
    verifier.close()


def test_shorter_chains_than_the_draft_offers(exported, tiny_model_dir, prompts):
    _, _, out = exported
    proposer = load_exported_draft(out, tiny_model_dir)
    verifier, _ = load_verifier(tiny_model_dir, proposer.layer_ids)
    report = evaluate(verifier, proposer, prompts[:1], max_new_tokens=12, num_speculative_tokens=2)
    assert report.exact_match and len(report.acceptance_rate) == 2
    if (
        proposer.algorithm != "eagle3"
    ):  # one block: at most its proposals (DFlash block_size - 1, DSpark block_size)
        with pytest.raises(ValueError, match="exceeds the draft's limit of 4"):
            evaluate(verifier, proposer, prompts[:1], max_new_tokens=4, num_speculative_tokens=9)
    else:  # a chain runs past its training-time-test steps, as vLLM's num_speculative_tokens allows
        long = evaluate(verifier, proposer, prompts[:1], max_new_tokens=16, num_speculative_tokens=6)
        assert long.exact_match and len(long.acceptance_rate) == 6
    out_tokens = speculative_generate(verifier, proposer, prompts[0].token_ids, 12, 1)
    assert out_tokens.tokens == verifier.greedy(prompts[0].token_ids, 12)
    verifier.close()


def test_export_errors_name_the_file_and_field(exported, tiny_model_dir, tmp_path):
    _, _, out = exported
    with pytest.raises(DraftLoadError, match="config.json: not found"):
        load_exported_draft(tmp_path, tiny_model_dir)
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "model.safetensors").write_bytes((out / "model.safetensors").read_bytes())
    cfg = json.loads((out / "config.json").read_text())
    key = (
        "aux_hidden_state_layer_ids"
        if cfg["speculators_model_type"] != "eagle3"
        else "eagle_aux_hidden_state_layer_ids"
    )
    del cfg[key]
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(DraftLoadError, match=rf"bad/config.json: missing field '{key}'"):
        load_exported_draft(bad, tiny_model_dir)
    cfg = json.loads((out / "config.json").read_text())
    cfg["transformer_layer_config"]["intermediate_size"] += 8
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(DraftLoadError, match="has shape"):
        load_exported_draft(bad, tiny_model_dir)
    (bad / "config.json").write_text("{\n  oops")
    with pytest.raises(DraftLoadError, match=r"config.json:2: invalid JSON"):
        load_exported_draft(bad, tiny_model_dir)


@pytest.fixture(scope="module")
def constant_verifier(tiny_model_dir, tmp_path_factory):
    """The tiny verifier with an all-zero LM head: every logit is 0, so its greedy token is always
    id 0, and a draft sharing (DFlash) or copying (Eagle3) that head proposes exactly that."""
    import shutil

    from safetensors.torch import load_file, save_file

    out = tmp_path_factory.mktemp("constant") / "verifier"
    shutil.copytree(tiny_model_dir, out)
    weights = load_file(str(out / "model.safetensors"))
    weights["lm_head.weight"] = torch.zeros_like(weights["lm_head.weight"])
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


@pytest.mark.parametrize("algorithm", sorted(DRAFTS))
def test_a_perfect_real_draft_accepts_everything(algorithm, constant_verifier, prompts, tmp_path):
    model = _random_draft(constant_verifier, algorithm)
    if algorithm == "dspark":  # no Markov bias: the draft's logits are the verifier's head's (all 0)
        torch.nn.init.zeros_(model.markov_head.markov_w2.weight)
    out = export_draft(model, tmp_path / "draft", verifier_name="constant")
    proposer = load_exported_draft(out, constant_verifier)
    verifier, _ = load_verifier(constant_verifier, proposer.layer_ids)
    k = proposer.num_speculative_tokens
    report = evaluate(verifier, proposer, prompts, max_new_tokens=1 + 3 * (k + 1))
    assert report.exact_match
    assert all(r["new_tokens"] == 3 * (k + 1) for r in report.per_prompt)  # the prefill token is not a step
    assert report.steps == 3 * len(prompts)
    assert report.tau == pytest.approx(k + 1)  # the upper bound: every proposal accepted
    assert report.acceptance_rate == [1.0] * k
    assert report.accepted_histogram == [0] * k + [report.steps]
    verifier.close()
