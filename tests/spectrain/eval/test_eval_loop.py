"""The speculative decoding loop with deterministic proposers: exactness and bookkeeping."""

from __future__ import annotations

import random

import pytest
import torch

from spectrain.eval.decode import (
    EvalPrompt,
    Verifier,
    evaluate,
    load_verifier,
    speculative_generate,
    summarize,
)

torch.set_num_threads(1)

LAYER_IDS = (1, 2, 4)


@pytest.fixture(scope="module")
def verifier(tiny_model_dir) -> Verifier:
    v, _ = load_verifier(tiny_model_dir, LAYER_IDS, dtype="float64")
    return v


@pytest.fixture(scope="module")
def prompts(tiny_model_dir) -> list[EvalPrompt]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    texts = [
        "def main():\n    return",
        "import os\nimport sys\n",
        "class Foo:\n    def __init__(self",
        "x = [1, 2,",
    ]
    return [EvalPrompt(f"p{i}", tuple(tok.encode(t)), f"text:{i}") for i, t in enumerate(texts)]


class OracleProposer:
    """Knows the verifier's greedy continuation: proposes it, optionally wrong after ``correct`` tokens."""

    layer_ids = LAYER_IDS

    def __init__(
        self, greedy: dict[tuple[int, ...], list[int]], k: int, correct: int | None = None, vocab: int = 1024
    ):
        self.greedy = greedy
        self.num_speculative_tokens = k
        self.correct = correct
        self.vocab = vocab
        self.calls: list[tuple[int, tuple[int, ...]]] = []

    def propose(self, token_ids, hidden_states, num_tokens):
        self.calls.append((len(token_ids), tuple(hidden_states.shape)))
        for prompt, cont in self.greedy.items():
            n = len(prompt)
            if tuple(token_ids[:n]) == prompt:
                done = len(token_ids) - n
                assert list(token_ids[n:]) == cont[:done], "context is not the greedy output"
                truth = cont[done : done + num_tokens]
                truth += [0] * (num_tokens - len(truth))
                if self.correct is not None:
                    truth = [t if i < self.correct else (t + 1) % self.vocab for i, t in enumerate(truth)]
                return truth
        raise AssertionError("unknown prompt")


class RandomProposer:
    layer_ids = LAYER_IDS

    def __init__(self, k: int, seed: int = 0):
        self.num_speculative_tokens = k
        self.rng = random.Random(seed)

    def propose(self, token_ids, hidden_states, num_tokens):
        return [self.rng.randrange(1024) for _ in range(num_tokens)]


def _greedy(verifier, prompts, n):
    return {p.token_ids: verifier.greedy(p.token_ids, n) for p in prompts}


def test_perfect_draft_accepts_everything(verifier, prompts):
    n, k = 24, 4
    greedy = _greedy(verifier, prompts, n)
    proposer = OracleProposer(greedy, k)
    report = evaluate(verifier, proposer, prompts, max_new_tokens=n)
    assert report.exact_match and not report.mismatches
    for p in prompts:
        out = speculative_generate(verifier, proposer, p.token_ids, n, k)
        assert out.tokens == greedy[p.token_ids]
        assert out.accepted == out.proposed  # every proposal accepted (up to an EOS)
        assert sum(out.emitted) == len(out.tokens) - 1  # the prefill token is not a step
    assert report.acceptance_rate == [1.0] * k
    assert report.conditional_acceptance == [1.0] * k
    # 23 tokens after the prefill at 5 per step: 4 full steps and a 3-token tail step, per prompt
    if all(len(g) == n and verifier.eos_token_ids.isdisjoint(g) for g in greedy.values()):
        assert report.steps == 5 * len(prompts)
        assert report.tau == pytest.approx(23 / 5)
        assert report.accepted_histogram == [0, 0, len(prompts), 0, 4 * len(prompts)]
    assert 1.0 <= report.tau <= k + 1


@pytest.mark.parametrize("correct", [0, 1, 3])
def test_per_position_bookkeeping(verifier, prompts, correct):
    n, k = 20, 4
    greedy = _greedy(verifier, prompts, n)
    proposer = OracleProposer(greedy, k, correct=correct)
    report = evaluate(verifier, proposer, prompts, max_new_tokens=n)
    assert report.exact_match
    # every step accepts exactly min(correct, proposed) tokens
    for i, rate in enumerate(report.acceptance_rate, start=1):
        assert rate == (1.0 if i <= correct else 0.0)
    assert sum(report.accepted_histogram) == report.steps
    assert report.accepted_histogram[correct] >= report.steps - len(prompts)
    assert report.tau == pytest.approx(report.new_tokens / report.steps)
    assert report.tau <= correct + 1 + 1e-9


def test_random_draft_is_exact_and_near_one(verifier, prompts):
    report = evaluate(verifier, RandomProposer(5), prompts, max_new_tokens=16)
    assert report.exact_match
    assert 1.0 <= report.tau < 1.5
    assert report.steps == report.new_tokens  # tau == 1 exactly unless a random token matched
    assert len(report.per_prompt) == len(prompts) and all(r["exact"] for r in report.per_prompt)


def test_hidden_states_given_to_the_draft(tiny_model_dir, prompts):
    """The draft sees the server's hidden states (same layer numbering) for all but the bonus token."""
    from hsgen.serve.hidden import HiddenStateExtractor, load_model

    v, _ = load_verifier(tiny_model_dir, LAYER_IDS, dtype="float32")
    seen = {}

    class Spy(RandomProposer):
        def propose(self, token_ids, hidden_states, num_tokens):
            seen[tuple(token_ids)] = hidden_states.clone()
            return super().propose(token_ids, hidden_states, num_tokens)

    speculative_generate(v, Spy(3), prompts[0].token_ids, 10, 3)
    ext = HiddenStateExtractor(load_model(str(tiny_model_dir), dtype="float32"), LAYER_IDS)
    for seq, hidden in seen.items():
        assert hidden.shape == (len(seq) - 1, len(LAYER_IDS), 64)
        ref = ext.forward([list(seq[:-1])])[0].hidden_states
        torch.testing.assert_close(hidden, ref.float(), atol=1e-4, rtol=1e-4)
    ext.close()
    v.close()


def test_summarize_counts():
    from spectrain.eval.decode import SpeculativeOutput

    o = SpeculativeOutput(tokens=list(range(9)), accepted=[2, 0, 3], proposed=[3, 3, 3], emitted=[3, 1, 4])
    r = summarize([o], 3)
    assert r.steps == 3 and r.new_tokens == 8 and r.tau == pytest.approx(8 / 3)
    assert r.accepted_histogram == [1, 0, 1, 1]
    assert r.acceptance_rate == pytest.approx([2 / 3, 2 / 3, 1 / 3])
    assert r.conditional_acceptance == pytest.approx([2 / 3, 1.0, 0.5])


def test_bad_proposals_are_refused(verifier, prompts):
    class Short(RandomProposer):
        def propose(self, token_ids, hidden_states, num_tokens):
            return [1]

    class OutOfVocab(RandomProposer):
        def propose(self, token_ids, hidden_states, num_tokens):
            return [10**6] * num_tokens

    with pytest.raises(RuntimeError, match="proposed 1 tokens"):
        speculative_generate(verifier, Short(3), prompts[0].token_ids, 8, 3)
    with pytest.raises(RuntimeError, match="outside the vocabulary"):
        speculative_generate(verifier, OutOfVocab(3), prompts[0].token_ids, 8, 3)
