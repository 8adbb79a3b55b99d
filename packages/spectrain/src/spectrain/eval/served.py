"""Acceptance of a draft where it is served: vLLM's spec-decode counters over a set of prompts.

``spectrain eval --endpoint URL`` sends each prompt (token ids, greedy, one request at a time) to a
vLLM server that runs the draft with speculative decoding, reads vLLM's Prometheus counters on
``/metrics`` before and after, and reports the served acceptance: ``tau = 1 + accepted / drafts``
(vLLM counts every accepted proposal of a step, even past ``max_tokens``; the local run beside it
counts the same way, see :func:`spectrain.eval.decode.speculative_generate`), the per-position rates,
and whether every served output equals the verifier's greedy output computed here.

The counters are the server's totals: the measurement is only this run's when nothing else
sends requests to that server meanwhile (checked: the request counter must grow by exactly the
number of prompts sent).
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from hsgen.protocol.extraction import MODELS_PATH, ProtocolError, prometheus_samples, served_model_ids


class EndpointError(RuntimeError):
    """The endpoint cannot be measured (unreachable, no spec-decode counters, shared with others)."""


@dataclass
class SpecCounters:
    """vLLM's cumulative spec-decode counters (summed over engines)."""

    drafts: float = 0.0
    draft_tokens: float = 0.0
    accepted: float = 0.0
    accepted_per_pos: dict[int, float] = field(default_factory=dict)
    requests: float = 0.0

    def __sub__(self, other: SpecCounters) -> SpecCounters:
        pos = {p: v - other.accepted_per_pos.get(p, 0.0) for p, v in self.accepted_per_pos.items()}
        return SpecCounters(self.drafts - other.drafts, self.draft_tokens - other.draft_tokens,
                            self.accepted - other.accepted, pos, self.requests - other.requests)  # fmt: skip


def parse_metrics(text: str) -> SpecCounters:
    """The spec-decode counters of a Prometheus text page (``vllm:spec_decode_*_total``) and the
    finished-request count (``vllm:request_success_total``)."""
    out = SpecCounters()
    seen = False
    for name, labels, value in prometheus_samples(text):
        if name == "vllm:spec_decode_num_drafts_total":
            out.drafts += value
            seen = True
        elif name == "vllm:spec_decode_num_draft_tokens_total":
            out.draft_tokens += value
        elif name == "vllm:spec_decode_num_accepted_tokens_total":
            out.accepted += value
        elif name == "vllm:spec_decode_num_accepted_tokens_per_pos_total":
            pos = int(labels.get("position", "0"))
            out.accepted_per_pos[pos] = out.accepted_per_pos.get(pos, 0.0) + value
        elif name == "vllm:request_success_total":
            out.requests += value
    if not seen:
        raise EndpointError("no vllm:spec_decode_num_drafts_total on /metrics: is the server running a draft "
                            "(--speculative-config with \"method\") and is it vLLM?")  # fmt: skip
    return out


def _request(url: str, path: str, body: Any = None, api_key: str | None = None, timeout: float = 600.0):
    data = None if body is None else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    req = urllib.request.Request(url.rstrip("/") + path, data=data, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            raw = r.read()
    except urllib.error.HTTPError as e:
        raise EndpointError(
            f"{url}{path}: HTTP {e.code}: {e.read()[:500].decode(errors='replace')}"
        ) from None
    except (urllib.error.URLError, OSError) as e:
        raise EndpointError(f"{url}{path}: {e}") from None
    return raw


def read_counters(url: str, api_key: str | None = None) -> SpecCounters:
    return parse_metrics(_request(url, "/metrics", api_key=api_key).decode())


def served_model(url: str, api_key: str | None = None) -> str:
    try:
        return served_model_ids(_request(url, MODELS_PATH, api_key=api_key))[0]
    except ProtocolError as e:
        raise EndpointError(f"{url}{MODELS_PATH}: no model listed ({e})") from None


def complete(url: str, model: str, prompt_ids: Sequence[int], max_tokens: int, api_key: str | None = None,
             ignore_eos: bool = False) -> list[int]:  # fmt: skip
    """Greedy completion of ``prompt_ids``; returns the generated token ids."""
    body = {"model": model, "prompt": [int(t) for t in prompt_ids], "max_tokens": int(max_tokens),
            "temperature": 0.0, "return_token_ids": True, "skip_special_tokens": False,
            "ignore_eos": ignore_eos}  # fmt: skip
    resp = json.loads(_request(url, "/v1/completions", body, api_key=api_key))
    choice = resp["choices"][0]
    if choice.get("prompt_token_ids") not in (None, list(prompt_ids)):
        raise EndpointError(f"{url}: the server tokenized the prompt differently (prompt_token_ids differ)")
    ids = choice.get("token_ids")
    if ids is None:
        raise EndpointError(
            f"{url}: the answer has no token_ids (vLLM >= 0.10 returns them with return_token_ids)"
        )
    return [int(t) for t in ids]


@dataclass
class ServedReport:
    """What the endpoint measured (``to_dict`` goes under ``served`` in ``spectrain eval --json``).

    Attributes:
        tau: ``1 + accepted / drafts`` from vLLM's counters.
        acceptance_rate: per draft position, accepted at that position / drafts.
        exact_match: every served output equalled the local greedy output.
    """

    endpoint: str
    model: str
    num_prompts: int = 0
    drafts: int = 0
    draft_tokens: int = 0
    accepted: int = 0
    tau: float = 0.0
    acceptance_rate: list[float] = field(default_factory=list)
    exact_match: bool = True
    mismatches: list[dict[str, Any]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def evaluate_endpoint(url: str, prompts, max_new_tokens: int, *, reference: Sequence[Sequence[int]] | None = None,
                      api_key: str | None = None, progress: bool = False,
                      ignore_eos: bool = False) -> ServedReport:  # fmt: skip
    """Send every prompt (``spectrain.eval.decode.EvalPrompt``) to ``url`` and read the counters' growth.

    ``reference``: the local greedy outputs, one per prompt, compared with the served ones.
    ``ignore_eos``: vLLM generates ``max_new_tokens`` tokens whatever it emits (as the local run must).
    """
    from hsgen.progress import progress_bar

    model = served_model(url, api_key)
    before = read_counters(url, api_key)
    outputs = []
    for p in progress_bar(prompts, desc="served", unit="prompt", disable=not progress):
        outputs.append(complete(url, model, p.token_ids, max_new_tokens, api_key, ignore_eos))
    delta = read_counters(url, api_key) - before
    if delta.requests and int(round(delta.requests)) != len(prompts):
        raise EndpointError(f"{url}: {int(delta.requests)} requests finished while {len(prompts)} were sent: "
                            "someone else is using this server, the counters are not this run's")  # fmt: skip
    if delta.drafts <= 0:
        raise EndpointError(f"{url}: no speculative step ran (spec_decode_num_drafts did not grow)")
    report = ServedReport(
        url, model, len(prompts), int(delta.drafts), int(delta.draft_tokens), int(delta.accepted)
    )
    report.tau = 1.0 + delta.accepted / delta.drafts
    report.acceptance_rate = [
        delta.accepted_per_pos[p] / delta.drafts for p in sorted(delta.accepted_per_pos)
    ]
    if reference is not None:
        for p, got, want in zip(prompts, outputs, reference, strict=True):
            if list(got) != list(want):
                at = next(
                    (i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b),
                    min(len(got), len(want)),
                )
                report.mismatches.append({"id": p.prompt_id, "source": p.source, "first_difference": at})
        report.exact_match = not report.mismatches
    return report
