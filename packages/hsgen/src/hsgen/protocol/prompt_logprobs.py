"""vLLM's ``prompt_logprobs``: the verifier's top-k at every prompt position, both ways.

The client asks for them (``prompt_logprobs: 1`` in the completion request, see
:func:`hsgen.protocol.extraction.completion_request`) to store the verifier's greedy targets as token ids
in place of its final layer (``hsgen generate --targets argmax``); the reference server answers
them exactly as vLLM does. Standard library only.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from hsgen.protocol.extraction import ExtractionResult, ProtocolError


def parse_target_ids(result: ExtractionResult, k: int) -> list[int]:
    """The verifier's greedy next token after every prompt position, from a response to a
    request with ``prompt_logprobs = k`` (and ``temperature = 0``).

    vLLM's ``prompt_logprobs`` is a list with one entry per prompt token: ``None`` for the
    first, then for token ``i`` a map ``"token id" -> {"logprob", "rank", "decoded_token"}``
    holding the distribution that predicted token ``i``: its top ``k`` (ranks 1..k) plus the
    prompt token itself (its own rank, which may exceed ``k``). So the target after position
    ``t`` is entry ``t + 1``'s rank-1 token, and after the last position it is the token the
    request generated greedily. Every entry is checked against what was asked: the list's
    length, the echoed prompt token present, ranks 1..k each exactly once, nothing else.

    Raises:
        ProtocolError: the field is missing or does not say that (one line naming the position).
    """
    entries = result.prompt_logprobs
    prompt = result.prompt_token_ids
    if entries is None:
        raise ProtocolError(
            "response has no prompt_logprobs: the server ignored the request's prompt_logprobs"
        )
    if not isinstance(entries, list) or len(entries) != len(prompt):
        n = len(entries) if isinstance(entries, list) else type(entries).__name__
        raise ProtocolError(f"prompt_logprobs has {n} entries for {len(prompt)} prompt tokens")
    if entries and entries[0] is not None:
        raise ProtocolError("prompt_logprobs[0] must be null (nothing predicts the first token)")
    if not result.output_token_ids:
        raise ProtocolError("response has no generated token ids: send return_token_ids=true")
    targets = []
    for i in range(1, len(entries)):
        targets.append(_top_token(entries[i], prompt[i], k, i))
    targets.append(int(result.output_token_ids[0]))
    return targets


def prompt_logprobs_entries(
    prompt_token_ids: Sequence[int],
    top_ids: Sequence[Sequence[int]],
    top_logprobs: Sequence[Sequence[float]],
    token_logprobs: Sequence[float],
    token_ranks: Sequence[int],
    decode: Any,
) -> list[dict[str, dict[str, Any]] | None]:
    """``choices[i].prompt_logprobs`` as vLLM writes it, from the distributions that predicted
    prompt tokens ``1..T-1`` (row ``i`` predicted token ``i + 1``): ``None``, then per token a map
    whose first key is the prompt token (its own rank), then the top k in rank order; a prompt
    token among them keeps its first place and takes its top-k rank, as vLLM's dict does (its
    counted rank exceeds the top-k one when it ties a token ranked before it). ``-inf`` becomes
    ``-9999.0``, as vLLM clamps it;
    ``decode(id)`` gives ``decoded_token`` (vLLM: the tokenizer's token string).
    """
    out: list[dict[str, dict[str, Any]] | None] = [None]
    for i in range(len(prompt_token_ids) - 1):
        entry = {
            str(int(prompt_token_ids[i + 1])): _logprob(
                token_logprobs[i], token_ranks[i], prompt_token_ids[i + 1], decode
            )
        }
        for r, (tid, lp) in enumerate(zip(top_ids[i], top_logprobs[i], strict=True), start=1):
            entry[str(int(tid))] = _logprob(lp, r, tid, decode)
        out.append(entry)
    return out


def _logprob(value: float, rank: int, token: int, decode: Any) -> dict[str, Any]:
    v = float(value)
    return {
        "logprob": -9999.0 if v == float("-inf") else v,
        "rank": int(rank),
        "decoded_token": decode(int(token)),
    }


def _top_token(entry: Any, prompt_id: int, k: int, i: int) -> int:
    """The rank-1 token of ``prompt_logprobs[i]`` after checking the entry (see :func:`parse_target_ids`).

    vLLM (0.32, ``batched_count_greater_than``) ranks the prompt token by the tokens at least as
    likely, itself included, so a prompt token tied with the top token that ``topk`` did not pick
    is listed with rank 2 (or more) beside it; a server ranking by the tokens strictly more likely
    would list it with rank 1 beside the top token. Either way, when the other keys hold ranks
    1..k on their own the target is theirs; when the prompt token is one of the top k, the other
    keys hold the rest.
    """
    if not isinstance(entry, Mapping):
        raise ProtocolError(f"prompt_logprobs[{i}] is not an object: {entry!r:.80}")
    others: dict[int, int] = {}  # rank -> token, the keys other than the prompt token
    prompt_rank = None
    for key, info in entry.items():
        try:
            token, rank = int(key), info["rank"]
        except (ValueError, TypeError, KeyError):
            raise ProtocolError(f"prompt_logprobs[{i}] has a malformed entry {key!r}: {info!r:.80}") from None
        if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
            raise ProtocolError(f"prompt_logprobs[{i}][{key}] has rank {rank!r}")
        if token == prompt_id:
            prompt_rank = rank
            continue
        if rank > k or rank in others:
            raise ProtocolError(f"prompt_logprobs[{i}]: rank {rank} repeated or beyond the {k} asked for")
        others[rank] = token
    if prompt_rank is None:
        raise ProtocolError(
            f"prompt_logprobs[{i}] lacks the prompt token {prompt_id} (another prompt's answer?)"
        )
    want = set(range(1, k + 1))
    if set(others) == want:  # the prompt token outside the top k (or tied with one of them)
        return others[1]
    if prompt_rank <= k and set(others) | {prompt_rank} == want and prompt_rank not in others:
        return prompt_id if prompt_rank == 1 else others[1]
    raise ProtocolError(f"prompt_logprobs[{i}] holds ranks {sorted([*others, prompt_rank])}, not 1..{k}")
