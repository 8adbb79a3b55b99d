"""``spectrain eval --endpoint``'s pieces that need no server: vLLM's counting of a step, the counters."""

from __future__ import annotations

import pytest
import torch
from test_eval_loop import LAYER_IDS, OracleProposer, _greedy

from spectrain.eval.decode import EvalPrompt, load_verifier, speculative_generate
from spectrain.eval.served import EndpointError, parse_metrics

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def verifier(tiny_model_dir):
    v, _ = load_verifier(tiny_model_dir, LAYER_IDS, dtype="float64")
    return v


@pytest.fixture(scope="module")
def prompts(tiny_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    texts = [
        "def main():\n    return",
        "import os\nimport sys\n",
        "x = [1, 2,",
        "class Foo:\n    def __init__(self",
    ]
    return [EvalPrompt(f"p{i}", tuple(tok.encode(t))) for i, t in enumerate(texts)]


def test_vllm_counting_drafts_k_every_step_and_counts_past_max_tokens(verifier, prompts):
    n, k = 12, 4
    greedy = _greedy(verifier, prompts, n + k + 1)
    # a prompt whose greedy continuation has no EOS in reach (the arithmetic below assumes none)
    prompt = next(p for p in prompts if verifier.eos_token_ids.isdisjoint(greedy[p.token_ids][: n + k + 1]))
    ours = speculative_generate(verifier, OracleProposer(greedy, k), prompt.token_ids, n, k)
    theirs = speculative_generate(
        verifier, OracleProposer(greedy, k), prompt.token_ids, n, k, counting="vllm"
    )
    assert ours.tokens == theirs.tokens == greedy[prompt.token_ids][:n]  # the same output either way
    # 11 tokens after the prefill: ours 5+5+1 (budget cut to what fits), vLLM's 5+5+5 (always K, all counted)
    assert ours.proposed == [4, 4, 0] and ours.emitted == [5, 5, 1]
    assert theirs.proposed == [4, 4, 4] and theirs.accepted == [4, 4, 4] and theirs.emitted == [5, 5, 5]


def test_vllm_counting_stops_the_output_at_eos_but_counts_the_step(verifier, prompts):
    n, k = 40, 4
    greedy = _greedy(verifier, prompts, n)
    ended = [p for p in prompts if not verifier.eos_token_ids.isdisjoint(greedy[p.token_ids])]
    assert ended, "no prompt reaches EOS: the test proves nothing"
    for p in ended:
        out = speculative_generate(verifier, OracleProposer(greedy, k), p.token_ids, n, k, counting="vllm")
        assert out.tokens == greedy[p.token_ids] and out.tokens[-1] in verifier.eos_token_ids
        assert out.proposed[-1] == k and out.emitted[-1] == out.accepted[-1] + 1


def test_vllm_counting_rejects_an_unknown_mode(verifier, prompts):
    with pytest.raises(ValueError, match="counting"):
        speculative_generate(verifier, OracleProposer({}, 2), prompts[0].token_ids, 4, 2, counting="sglang")


METRICS = """\
# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 10.0
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 30.0
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 7.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="0"} 5.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="1"} 2.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="2"} 0.0
vllm:request_success_total{engine="0",finished_reason="length",model_name="m"} 3.0
vllm:request_success_total{engine="0",finished_reason="stop",model_name="m"} 1.0
vllm:spec_decode_num_drafts_created 1.7e9
"""


def test_parse_metrics_and_deltas():
    c = parse_metrics(METRICS)
    assert (c.drafts, c.draft_tokens, c.accepted, c.requests) == (10, 30, 7, 4)
    assert c.accepted_per_pos == {0: 5, 1: 2, 2: 0}
    later = parse_metrics(METRICS.replace(" 10.0", " 14.0").replace('position="0"} 5.0', 'position="0"} 8.0'))
    d = later - c
    assert d.drafts == 4 and d.accepted_per_pos == {0: 3, 1: 0, 2: 0} and d.requests == 0


def test_parse_metrics_without_spec_decoding_names_the_cause():
    with pytest.raises(EndpointError, match="speculative-config"):
        parse_metrics('vllm:num_requests_running{engine="0"} 0.0\n')
