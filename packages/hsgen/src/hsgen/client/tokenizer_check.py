"""Before any work is sent: does the local tokenizer tokenize like the served model?

``hsgen generate`` renders prompts with ``--tokenizer`` and sends token ids; a server running
another model accepts them all and the whole generation is wasted (only training would refuse the
store). So before the first request, each endpoint's ``POST /tokenize`` (vLLM's, and ``hsgen
serve``'s) tokenizes :data:`PROBE`, text meant to split differently under any two vocabularies,
and the ids are compared with the local tokenizer's. A server without ``/tokenize`` or not
answering yet is skipped with a warning (the generation's own probe waits for servers); a
mismatch is one line naming the flag, the endpoint and the served model.
"""

from __future__ import annotations

import json
import logging
import urllib.error
import urllib.request
from collections.abc import Sequence

from hsgen.client.config import normalize_endpoint
from hsgen.protocol import extraction as protocol

log = logging.getLogger(__name__)

PROBE = (
    "Hello, world! The quick brown fox: 12345 + 6789 = 19134.\n\tdef f(x): return x ** 2  # ünïcødé 日本語"
)


class TokenizerMismatch(ValueError):
    """The local tokenizer and a served model's disagree on the probe."""


def _post(url: str, body: dict, api_key: str | None, timeout: float) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json", **protocol.auth_headers(api_key)})  # fmt: skip
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def _served_model(base: str, api_key: str | None, timeout: float) -> str | None:
    req = urllib.request.Request(base + "/v1/models", headers=protocol.auth_headers(api_key))
    with urllib.request.urlopen(req, timeout=timeout) as r:
        data = json.loads(r.read()).get("data") or []
    return str(data[0]["id"]) if data else None


def check_served_tokenizer(endpoints: Sequence[str], local_ids: list[int], *, flag: str, api_key: str | None = None,
                           model: str | None = None, timeout: float = 10.0) -> list[str]:  # fmt: skip
    """Compare ``local_ids`` (the probe tokenized locally, no special tokens) with each endpoint's;
    returns the endpoints checked. Raises :class:`TokenizerMismatch` on the first disagreement."""
    checked = []
    for url in endpoints:
        base = normalize_endpoint(url)
        try:
            served = model or _served_model(base, api_key, timeout)
            got = _post(base + "/tokenize", {"model": served, "prompt": PROBE, "add_special_tokens": False},
                        api_key, timeout).get("tokens")  # fmt: skip
        except (urllib.error.URLError, OSError, ValueError, KeyError) as e:
            log.warning("%s: tokenizer not checked against the server (%s)", base, getattr(e, "reason", e))
            continue
        if list(got or []) != list(local_ids):
            first = next((i for i, (a, b) in enumerate(zip(local_ids, got or [], strict=False)) if a != b),
                         min(len(local_ids), len(got or [])))  # fmt: skip
            raise TokenizerMismatch(
                f"{flag} tokenizes differently from the model {served!r} served at {base} (probe token {first}: "
                f"{local_ids[first : first + 3]} here, {list(got or [])[first : first + 3]} there): pass that "
                f"model's tokenizer as {flag}, or the endpoint of the model it belongs to"
            )
        checked.append(base)
    return checked
