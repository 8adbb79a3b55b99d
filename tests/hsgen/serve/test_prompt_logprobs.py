"""vLLM's ``prompt_logprobs``: what the reference server answers and what the client takes from it."""

from __future__ import annotations

import json

import pytest

from hsgen.protocol.extraction import ExtractionResult, ProtocolError, completion_request
from hsgen.protocol.prompt_logprobs import parse_target_ids, prompt_logprobs_entries


def _result(prompt, entries, output=(7,)) -> ExtractionResult:
    return ExtractionResult("cmpl-x", "/tmp/x", tuple(prompt), tuple(output), "length", {}, entries)


def _wire(prompt, top, k, next_token=7):
    """Entries as they cross the wire (JSON keys are strings), for rows ``top[i]`` = ranked ids."""
    ranks = []
    for i in range(len(prompt) - 1):
        ranked = top[i]
        tok = prompt[i + 1]
        ranks.append(ranked.index(tok) + 1 if tok in ranked else len(ranked) + 5)
    entries = prompt_logprobs_entries(
        prompt,
        [row[:k] for row in top],
        [[-0.1 * (r + 1) for r in range(k)] for _ in top],
        [-0.1 * r if r <= k else -float(r) for r in ranks],
        ranks,
        lambda t: f"<{t}>",
    )
    return json.loads(json.dumps(entries)), next_token


def test_request_asks_for_prompt_logprobs_only_when_wanted():
    assert "prompt_logprobs" not in completion_request("m", [1, 2])
    assert completion_request("m", [1, 2], prompt_logprobs=1)["prompt_logprobs"] == 1
    with pytest.raises(ValueError, match=">= 1"):
        completion_request("m", [1, 2], prompt_logprobs=0)


def test_entries_follow_vllms_layout_and_give_the_greedy_targets():
    prompt = [5, 9, 3, 4]
    top = [[9, 1, 2], [8, 3, 1], [4, 2, 0]]  # ranked ids of the distributions after tokens 0..2
    entries, nxt = _wire(prompt, top, k=2)
    assert entries[0] is None and len(entries) == len(prompt)
    assert list(entries[1]) == ["9", "1"]  # the prompt token first; among the top k it keeps its place
    assert entries[1]["9"] == {"logprob": -0.1, "rank": 1, "decoded_token": "<9>"}
    assert list(entries[2]) == ["3", "8"] and entries[2]["3"]["rank"] == 2  # prompt token at rank 2
    k1, _ = _wire(prompt, top, k=1)
    assert list(k1[2]) == ["3", "8"] and k1[2]["3"]["rank"] > 1  # outside the top 1: k + 1 keys
    for k, e in ((1, k1), (2, entries)):
        assert parse_target_ids(_result(prompt, e, (nxt,)), k) == [9, 8, 4, nxt]


def test_a_prompt_token_tied_with_the_top_token_keeps_the_top_tokens_target():
    """Ties are common with a bf16 verifier. vLLM lists a prompt token tied with the top token that
    ``topk`` did not pick with rank 2 (it counts the tokens at least as likely); a server counting
    the tokens strictly more likely lists it with rank 1 beside the top token: both give its target."""
    entries = [None, {"9": {"logprob": -0.5, "rank": 2, "decoded_token": "a"},
                      "4": {"logprob": -0.5, "rank": 1, "decoded_token": "b"}}]  # fmt: skip
    assert parse_target_ids(_result([5, 9], entries, (3,)), 1) == [4, 3]
    entries[1]["9"]["rank"] = 1
    assert parse_target_ids(_result([5, 9], entries, (3,)), 1) == [4, 3]
    with pytest.raises(ProtocolError, match="rank 1 repeated"):
        parse_target_ids(_result([5, 9], [None, {**entries[1], "6": entries[1]["4"]}], (3,)), 1)


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda e: e[:-1], "3 entries for 4 prompt tokens"),
        (
            lambda e: [{"1": {"logprob": 0.0, "rank": 1, "decoded_token": ""}}, *e[1:]],
            r"prompt_logprobs\[0\] must be null",
        ),
        (
            lambda e: [e[0], {"8": e[1]["9"]}, *e[2:]],
            r"prompt_logprobs\[1\] lacks the prompt token 9",
        ),
        (
            lambda e: [
                e[0],
                {
                    **e[1],
                    "2": {"logprob": 0.0, "rank": 1, "decoded_token": ""},
                    "6": {"logprob": 0.0, "rank": 1, "decoded_token": ""},
                },
                *e[2:],
            ],  # fmt: skip
            "rank 1 repeated",
        ),
        (
            lambda e: [e[0], {"9": {"logprob": 0.0, "rank": 3, "decoded_token": ""}}, *e[2:]],
            r"ranks \[3\], not 1..1",
        ),
        (lambda e: [e[0], "x", *e[2:]], "is not an object"),
    ],
)
def test_a_response_that_does_not_say_what_was_asked_is_refused(mutate, message):
    prompt = [5, 9, 3, 4]
    entries, nxt = _wire(prompt, [[9, 1], [8, 3], [4, 2]], k=1)
    with pytest.raises(ProtocolError, match=message):
        parse_target_ids(_result(prompt, mutate(entries), (nxt,)), 1)


def test_missing_field_or_generated_token_is_refused():
    with pytest.raises(ProtocolError, match="no prompt_logprobs"):
        parse_target_ids(_result([1, 2], None), 1)
    entries, _ = _wire([1, 2], [[2]], k=1)
    with pytest.raises(ProtocolError, match="no generated token ids"):
        parse_target_ids(_result([1, 2], entries, ()), 1)


def test_reference_server_logprobs_equal_transformers_forward(tiny_model_dir):
    """The extractor's prompt logprobs against the model's own full forward (log-softmax of its logits)."""
    import torch

    from hsgen.serve.hidden import HiddenStateExtractor, load_model

    loaded = load_model(str(tiny_model_dir), dtype="float32")
    ext = HiddenStateExtractor(loaded, [1, 2])
    seqs = [[1, 5, 9, 40, 41, 7], [3, 8, 2]]
    outs = ext.forward(seqs, [3, None])
    assert outs[1].prompt_logprobs is None
    with torch.no_grad():
        logits = loaded.model(torch.tensor([seqs[0]])).logits[0].float()
    lp = torch.log_softmax(logits, -1)[:-1]
    got = outs[0].prompt_logprobs
    want = lp.topk(3, -1)
    assert torch.equal(got.top_ids, want.indices)
    torch.testing.assert_close(got.top_logprobs, want.values, rtol=1e-5, atol=1e-5)
    nxt = torch.tensor(seqs[0][1:])
    torch.testing.assert_close(got.token_logprobs, lp.gather(1, nxt[:, None])[:, 0], rtol=1e-5, atol=1e-5)
    ranks = (lp >= lp.gather(1, nxt[:, None])).sum(-1)  # vLLM's rank: tokens at least as likely
    assert torch.equal(got.token_ranks, ranks)
    entries = prompt_logprobs_entries(seqs[0], got.top_ids.tolist(), got.top_logprobs.tolist(),
                                      got.token_logprobs.tolist(), got.token_ranks.tolist(), str)  # fmt: skip
    targets = parse_target_ids(_result(seqs[0], json.loads(json.dumps(entries)), (outs[0].next_token,)), 3)
    assert targets == logits.argmax(-1).tolist()  # the verifier's greedy token after every position
    ext.close()


def test_reference_server_ranks_ties_as_vllm_does():
    """Tied logits (bf16): vLLM counts the tokens at least as likely, and a prompt token that
    ``topk`` picked takes its top-k rank (vLLM's dict keeps the later value under the first key)."""
    import torch

    from hsgen.serve.hidden import prompt_logprobs_of

    last = torch.tensor([[0.0, 2.0, 2.0, 1.0], [0.0, 2.0, 2.0, 1.0], [3.0, 3.0, 3.0, 0.0]])
    ids = [0, 1, 2, 3]  # token 1 ties the top (2.0), so does token 2; token 3 is below three
    plp = prompt_logprobs_of(torch.nn.Identity(), last, ids, 1)
    picked = plp.top_ids[:, 0].tolist()
    assert plp.token_ranks.tolist() == [2, 2, 4]
    entries = prompt_logprobs_entries(ids, plp.top_ids.tolist(), plp.top_logprobs.tolist(),
                                      plp.token_logprobs.tolist(), plp.token_ranks.tolist(), str)  # fmt: skip
    for i, entry in enumerate(entries[1:]):
        prompt = str(ids[i + 1])
        assert next(iter(entry)) == prompt
        if picked[i] == ids[i + 1]:
            assert list(entry) == [prompt] and entry[prompt]["rank"] == 1
        else:
            assert entry[prompt]["rank"] == plp.token_ranks[i] and entry[str(picked[i])]["rank"] == 1
    got = parse_target_ids(_result(ids, json.loads(json.dumps(entries)), (9,)), 1)
    assert got == [*picked, 9]


def test_reference_server_answers_and_checks_prompt_logprobs_like_vllm(tmp_path):
    import urllib.error
    import urllib.request

    from hsgen.serve.testing import running_server

    def post(url, body):
        req = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})  # fmt: skip
        try:
            with urllib.request.urlopen(req, timeout=600) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    with running_server("tiny", [1, 2], tmp_path / "shm", dtype="float32") as url:
        body = completion_request("tiny", [1, 5, 9, 40], prompt_logprobs=2)
        status, out = post(url, body)
        assert status == 200
        choice = out["choices"][0]
        entries = choice["prompt_logprobs"]
        assert entries[0] is None and len(entries) == 4
        for i, entry in enumerate(entries[1:], start=1):
            assert next(iter(entry)) == str(body["prompt"][i])  # the prompt token first
            assert sorted(
                v["rank"] for k, v in entry.items() if k != str(body["prompt"][i]) or v["rank"] <= 2
            )[:2] == [1, 2]
        result = _result(choice["prompt_token_ids"], entries, tuple(choice["token_ids"]))
        assert len(parse_target_ids(result, 2)) == 4
        assert post(url, completion_request("tiny", [1, 5]))[1]["choices"][0]["prompt_logprobs"] is None
        status, err = post(url, {**body, "prompt_logprobs": 21})
        assert status == 400 and "greater than max allowed: 20" in err["error"]["message"]
        status, err = post(url, {**body, "prompt_logprobs": -2})
        assert status == 400 and "must be a positive value or -1" in err["error"]["message"]
