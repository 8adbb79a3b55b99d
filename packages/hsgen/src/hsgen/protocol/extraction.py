"""vLLM's hidden-state extraction protocol: request bodies, responses, files, locks, layer ids.

Standard library only. Both the reference server (``hsgen.serve``) and the client
(``hsgen.client.fetch``) speak through this module, so the wire format is written down once.
The facts mirror vLLM 0.18 - 0.33 running ``--speculative_config '{"method":
"extract_hidden_states", ...}'`` with ``ExampleHiddenStatesConnector``; see ``docs/serve.md``.
"""

from __future__ import annotations

import json
import os
import re
import struct
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, BinaryIO

LOCK_SUFFIX = ".lock"
"""vLLM >= 0.22 holds ``flock(LOCK_EX)`` on ``<file>.lock`` while it writes ``<file>``."""

DEFAULT_SHARED_STORAGE_PATH = "/tmp"
"""``kv_connector_extra_config.shared_storage_path`` when not given."""

HIDDEN_STATES_KEY = "hidden_states"
TOKEN_IDS_KEY = "token_ids"

SAFETENSORS_DTYPES: dict[str, tuple[str, int]] = {
    "BF16": ("bfloat16", 2),
    "F16": ("float16", 2),
    "F32": ("float32", 4),
    "F64": ("float64", 8),
    "I64": ("int64", 8),
    "I32": ("int32", 4),
    "U8": ("uint8", 1),
    "BOOL": ("bool", 1),
    "F8_E4M3": ("float8_e4m3fn", 1),
}
"""safetensors dtype tag -> (logical dtype name, bytes per element)."""

LOGICAL_TO_SAFETENSORS = {name: tag for tag, (name, _) in SAFETENSORS_DTYPES.items()}

_REQUEST_ID_OK = re.compile(r"^[^/\x00]+$")


class ProtocolError(ValueError):
    """A response, file or header that does not follow vLLM's extraction protocol."""


# --------------------------------------------------------------------------- requests


def completion_request(
    model: str,
    prompt_token_ids: Sequence[int],
    *,
    include_output_tokens: bool = False,
    hidden_states_path: str | None = None,
    prompt_logprobs: int | None = None,
) -> dict[str, Any]:
    """Body of ``POST /v1/completions`` asking for the hidden states of one tokenized prompt.

    One prompt per request: vLLM returns ``kv_transfer_params`` for the first prompt only.
    ``max_tokens`` is 1 because the extraction runs as a one-token "speculative" pass.
    ``prompt_logprobs`` (k >= 1) also asks for the verifier's top-k at every prompt position
    (:func:`hsgen.protocol.prompt_logprobs.parse_target_ids` turns them into the greedy targets).
    """
    if len(prompt_token_ids) == 0:
        raise ValueError("prompt_token_ids is empty: vLLM rejects an empty decoder prompt")
    body: dict[str, Any] = {
        "model": model,
        "prompt": list(map(int, prompt_token_ids)),
        "max_tokens": 1,
        "n": 1,
        "temperature": 0.0,
        "return_token_ids": True,
    }
    if prompt_logprobs is not None:
        if prompt_logprobs < 1:
            raise ValueError(f"prompt_logprobs must be >= 1 to name the top token, got {prompt_logprobs}")
        body["prompt_logprobs"] = int(prompt_logprobs)
    params = _kv_transfer_params(include_output_tokens, hidden_states_path)
    if params:
        body["kv_transfer_params"] = params
    return body


def chat_request(
    model: str,
    messages: Sequence[Mapping[str, Any]],
    *,
    include_output_tokens: bool = False,
    hidden_states_path: str | None = None,
) -> dict[str, Any]:
    """Body of ``POST /v1/chat/completions`` for a whole conversation (no generation prompt)."""
    body: dict[str, Any] = {
        "model": model,
        "messages": [dict(m) for m in messages],
        "max_tokens": 1,
        "n": 1,
        "temperature": 0.0,
        "add_generation_prompt": False,
        "return_token_ids": True,
    }
    params = _kv_transfer_params(include_output_tokens, hidden_states_path)
    if params:
        body["kv_transfer_params"] = params
    return body


def _kv_transfer_params(include_output_tokens: bool, hidden_states_path: str | None) -> dict[str, Any]:
    params: dict[str, Any] = {}
    if include_output_tokens:
        params["include_output_tokens"] = True
    if hidden_states_path is not None:
        if not os.path.isabs(hidden_states_path):
            raise ValueError(f"hidden_states_path must be absolute, got {hidden_states_path!r}")
        params["hidden_states_path"] = hidden_states_path
    return params


def check_request_id(request_id: str) -> str:
    """Return ``request_id`` if usable as an ``X-Request-Id`` header (it becomes part of a file name)."""
    if not _REQUEST_ID_OK.match(request_id):
        raise ValueError(f"X-Request-Id {request_id!r} must be non-empty and contain no '/'")
    return request_id


def redact_url(url: str) -> str:
    """``url`` with its userinfo (``user:key@``) replaced by ``<redacted>``: what may be printed or
    recorded. A URL without a scheme (``user:key@host:8000``, which the client gives ``http://``)
    is redacted the same way; the userinfo ends at the authority's last ``@`` (a key may hold one)."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        rest = url
    end = min((i for i in (rest.find(c) for c in "/?#") if i >= 0), default=len(rest))
    authority = rest[:end]
    if "@" not in authority:
        return url
    return f"{scheme + sep if sep else ''}<redacted>@{authority.rsplit('@', 1)[1]}{rest[end:]}"


def check_no_credentials(url: str, what: str = "--endpoint") -> str:
    """Return ``url`` if it carries no ``user:key@``; else ``ValueError`` naming the URL redacted.

    A URL is logged, recorded in stores and summaries and printed in errors, so credentials never
    travel in one: vLLM reads a bearer key (``--api-key`` / ``$VLLM_API_KEY``), nothing else.
    """
    if redact_url(url) != url:
        raise ValueError(
            f"{what} {redact_url(url)}: credentials in the URL are refused (URLs are logged and recorded); "
            "drop 'user:key@' and pass the key with --api-key or $VLLM_API_KEY"
        )
    return url


def auth_headers(api_key: str | None, request_id: str | None = None) -> dict[str, str]:
    """HTTP headers for a request: bearer token and request id, when given."""
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    if request_id is not None:
        headers["X-Request-Id"] = check_request_id(request_id)
    return headers


# --------------------------------------------------------------------------- responses


@dataclass(frozen=True)
class ExtractionResult:
    """What a completion (or chat) response says about one prompt's hidden states."""

    request_id: str
    hidden_states_path: str
    prompt_token_ids: tuple[int, ...]
    output_token_ids: tuple[int, ...] = ()
    finish_reason: str | None = None
    usage: Mapping[str, Any] = field(default_factory=dict)
    prompt_logprobs: Sequence[Any] | None = None
    """``choices[0].prompt_logprobs`` as sent (None when not asked for)."""


def parse_extraction_response(body: Mapping[str, Any]) -> ExtractionResult:
    """Parse a ``/v1/completions`` or ``/v1/chat/completions`` response body.

    Raises:
        ProtocolError: when ``kv_transfer_params.hidden_states_path`` or the prompt token
            ids are missing (a server not running ``extract_hidden_states``, or too old).
    """
    if not isinstance(body, Mapping):
        raise ProtocolError(f"response is not a JSON object: {type(body).__name__}")
    params = body.get("kv_transfer_params") or {}
    path = params.get("hidden_states_path") if isinstance(params, Mapping) else None
    if not isinstance(path, str) or not path:
        raise ProtocolError(
            "response has no kv_transfer_params.hidden_states_path: is the server running "
            "--speculative_config method extract_hidden_states with ExampleHiddenStatesConnector?"
        )
    choices = body.get("choices") or []
    if not choices:
        raise ProtocolError("response has no choices")
    choice = choices[0]
    prompt_ids = choice.get("prompt_token_ids")
    if prompt_ids is None:
        prompt_ids = body.get("prompt_token_ids")  # chat completions put them top level
    if prompt_ids is None:
        raise ProtocolError("response has no prompt_token_ids: send return_token_ids=true")
    output_ids = choice.get("token_ids") or ()
    return ExtractionResult(
        request_id=str(body.get("id", "")),
        hidden_states_path=path,
        prompt_token_ids=tuple(map(int, prompt_ids)),  # map: a generator costs ~1 ms per 1k-token prompt
        output_token_ids=tuple(map(int, output_ids)),
        finish_reason=choice.get("finish_reason"),
        usage=body.get("usage") or {},
        prompt_logprobs=choice.get("prompt_logprobs", body.get("prompt_logprobs")),
    )


def error_body(message: str, *, type_: str = "BadRequestError", code: int = 400) -> dict[str, Any]:
    """vLLM's (OpenAI-style) error body."""
    return {"error": {"message": message, "type": type_, "param": None, "code": code}}


def context_length_message(max_model_len: int, num_prompt_tokens: int, *, at_least: bool = False) -> str:
    """vLLM's (0.32) 400 message for a prompt longer than ``max_model_len`` (before vLLM appends
    `` (parameter=input_tokens, value=N)``); ``at_least`` when the count stopped at a limit."""
    return (
        f"This model's maximum context length is {max_model_len} tokens. However, your prompt contains "
        f"{'at least ' if at_least else ''}{num_prompt_tokens} input tokens, which exceeds this limit even "
        "without any output tokens. Please reduce the length of the input prompt."
    )


EMPTY_PROMPT_MESSAGE = "The decoder prompt cannot be empty"


# --------------------------------------------------------------------------- files


def completion_request_id(x_request_id: str | None = None) -> str:
    """The public id of a completion: ``cmpl-<X-Request-Id>`` (as vLLM: any text, a ``/`` included)
    or ``cmpl-<16 hex>``."""
    base = x_request_id if x_request_id else uuid.uuid4().hex[:16]
    return f"cmpl-{base}"


def hidden_states_filename(request_id: str, prompt_index: int = 0) -> str:
    """File name vLLM's connector uses: ``<request id>-<prompt index>-<8 hex>.safetensors``."""
    return f"{request_id}-{prompt_index}-{uuid.uuid4().hex[:8]}.safetensors"


def lock_path(path: str | os.PathLike[str]) -> str:
    """The lock file vLLM (>= 0.22) holds while writing ``path``."""
    return os.fspath(path) + LOCK_SUFFIX


def is_within(path: str | os.PathLike[str], directory: str | os.PathLike[str]) -> bool:
    """Whether ``path`` resolves to a location inside ``directory`` (symlinks resolved)."""
    real_path = os.path.realpath(path)
    real_dir = os.path.realpath(directory)
    return os.path.commonpath([real_path, real_dir]) == real_dir and real_path != real_dir


@dataclass(frozen=True)
class TensorInfo:
    """One tensor's entry in a safetensors header; offsets are absolute within the file."""

    name: str
    dtype: str  # logical name, e.g. "bfloat16"
    shape: tuple[int, ...]
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


def read_safetensors_header(
    f: BinaryIO, file_size: int | None = None, *, max_header_bytes: int = 100_000_000
) -> dict[str, TensorInfo]:
    """Parse and check a safetensors header from an open binary file (positioned anywhere).

    Accepts only what the safetensors library accepts (a differential test holds it to that):
    a UTF-8 JSON object; each tensor a known dtype, a shape of non-negative integers and
    ``data_offsets`` that match it; the tensors, in offset order, tile the data from its first
    byte with no gap or overlap; ``__metadata__``, if present, maps strings to strings.

    Raises:
        ProtocolError: the file is malformed, or shorter than its header says ("truncated";
            given ``file_size``, a file longer than its tensors is malformed).
    """
    f.seek(0)
    prefix = f.read(8)
    if len(prefix) != 8:
        raise ProtocolError("safetensors file shorter than its 8-byte header length")
    (header_len,) = struct.unpack("<Q", prefix)
    if header_len > max_header_bytes:
        raise ProtocolError(
            f"safetensors header length {header_len} is implausible (more than {max_header_bytes})"
        )
    raw = f.read(header_len)
    if len(raw) != header_len:
        raise ProtocolError("safetensors header is truncated")
    return _parse_safetensors_header(raw, file_size)


def _parse_safetensors_header(raw: bytes, file_size: int | None) -> dict[str, TensorInfo]:
    try:
        header = json.loads(raw.decode("utf-8")) if raw[:1] == b"{" else None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ProtocolError(f"safetensors header is not JSON: {e}") from None
    if not isinstance(header, dict):
        raise ProtocolError("safetensors header is not a JSON object")
    base = 8 + len(raw)
    tensors: dict[str, TensorInfo] = {}
    for name, entry in header.items():
        if name == "__metadata__":
            if not isinstance(entry, dict) or not all(isinstance(v, str) for v in entry.values()):
                raise ProtocolError(f"safetensors __metadata__ is not a map of strings: {entry!r:.200}")
            continue
        tensors[name] = _tensor_entry(name, entry, base)
    pos = base
    for t in sorted(tensors.values(), key=lambda t: (t.start, t.end)):
        if t.start != pos:
            raise ProtocolError(
                f"safetensors tensor {t.name!r} starts at data byte {t.start - base}, not {pos - base} "
                "(a gap or an overlap)"
            )
        pos = t.end
    if file_size is not None and pos > file_size:
        raise ProtocolError(
            f"safetensors data ends at byte {pos} but the file has {file_size} bytes (truncated)"
        )
    if file_size is not None and pos < file_size:
        raise ProtocolError(f"safetensors data ends at byte {pos} but the file has {file_size} bytes")
    return tensors


def _tensor_entry(name: str, entry: Any, base: int) -> TensorInfo:
    def whole(v: Any) -> bool:
        return isinstance(v, int) and not isinstance(v, bool) and v >= 0

    if not isinstance(entry, dict) or not {"dtype", "shape", "data_offsets"} <= set(entry):
        raise ProtocolError(f"safetensors entry {name!r} is malformed: {entry!r:.200}")
    tag, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if not isinstance(tag, str) or tag not in SAFETENSORS_DTYPES:
        raise ProtocolError(f"safetensors tensor {name!r} has unsupported dtype {tag!r:.50}")
    if not isinstance(shape, list) or not all(whole(s) for s in shape):
        raise ProtocolError(f"safetensors tensor {name!r} has a bad shape {shape!r:.200}")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(whole(x) for x in offsets):
        raise ProtocolError(f"safetensors tensor {name!r} has bad data_offsets {offsets!r:.200}")
    logical, itemsize = SAFETENSORS_DTYPES[tag]
    count = 1
    for s in shape:
        count *= s
    begin, end = offsets
    if end - begin != count * itemsize:
        raise ProtocolError(f"safetensors tensor {name!r}: offsets {begin}..{end} do not match shape {shape}")
    return TensorInfo(name, logical, tuple(shape), base + begin, base + end)


def safetensors_header_bytes(tensors: Sequence[tuple[str, str, Sequence[int]]]) -> tuple[bytes, list[int]]:
    """Build a safetensors header for ``(name, logical dtype, shape)`` in order.

    Returns the bytes to write before the data (length prefix + JSON, padded to 8 bytes)
    and the data offset of each tensor relative to the end of the header.
    """
    entries: dict[str, Any] = {}
    offsets = []
    pos = 0
    for name, dtype, shape in tensors:
        tag = LOGICAL_TO_SAFETENSORS[dtype]
        itemsize = SAFETENSORS_DTYPES[tag][1]
        n = itemsize
        for s in shape:
            n *= int(s)
        entries[name] = {"dtype": tag, "shape": [int(s) for s in shape], "data_offsets": [pos, pos + n]}
        offsets.append(pos)
        pos += n
    raw = json.dumps(entries, separators=(",", ":")).encode()
    raw += b" " * ((8 - len(raw) % 8) % 8)
    return struct.pack("<Q", len(raw)) + raw, offsets


# --------------------------------------------------------------------------- layer ids


def default_eagle3_layer_ids(num_hidden_layers: int) -> list[int]:
    """speculators' default extraction layers: ``[2, L//2, L-3]`` plus ``L`` for the targets."""
    L = num_hidden_layers
    return normalize_layer_ids([2, L // 2, L - 3, L], num_hidden_layers)


def default_dflash_layer_ids(num_hidden_layers: int, num_aux: int = 5) -> list[int]:
    """DFlash's default: ``num_aux`` layers spread evenly from 1 to ``L-3``, plus ``L``."""
    L = num_hidden_layers
    hi = max(1, L - 3)
    if num_aux <= 1:
        aux = [1]
    else:
        aux = [round(1 + i * (hi - 1) / (num_aux - 1)) for i in range(num_aux)]
    return normalize_layer_ids([*aux, L], num_hidden_layers)


def normalize_layer_ids(layer_ids: Sequence[int], num_hidden_layers: int | None = None) -> list[int]:
    """Sorted, unique layer ids, checked against ``0..num_hidden_layers`` when it is known."""
    ids = sorted({int(i) for i in layer_ids})
    if not ids:
        raise ValueError("layer ids must be a non-empty list")
    if ids[0] < 0:
        raise ValueError(f"layer ids must be >= 0, got {ids}")
    if num_hidden_layers is not None and ids[-1] > num_hidden_layers:
        raise ValueError(f"layer id {ids[-1]} exceeds the model's {num_hidden_layers} layers")
    return ids


def parse_layer_ids(text: str) -> list[int]:
    """Parse ``"2,18,33,36"`` or ``"2 18 33 36"`` into sorted unique ints."""
    parts = [p for p in re.split(r"[,\s]+", text.strip()) if p]
    try:
        return normalize_layer_ids([int(p) for p in parts])
    except ValueError as e:
        raise ValueError(f"bad layer ids {text!r}: {e}") from None


# --------------------------------------------------------------------------- metrics


_PROM_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def prometheus_samples(text: str) -> Iterator[tuple[str, dict[str, str], float]]:
    """Each sample of a Prometheus text exposition as ``(name, labels, value)``; comments and lines
    without a number are skipped. Quoted label values may hold spaces and braces."""
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        labels: dict[str, str] = {}
        if "{" in line:  # the value follows the last }
            name, rest = line[: line.index("{")], line[line.rfind("}") + 1 :]
            labels = dict(_PROM_LABEL.findall(line[line.index("{") + 1 : line.rfind("}")]))
        else:
            name, _, rest = line.partition(" ")
        value_text = rest.strip().split(" ")[0] if rest.strip() else ""
        try:
            value = float(value_text)
        except ValueError:
            continue
        yield name, labels, value


def parse_prometheus(text: str) -> dict[str, float]:
    """Sum each metric family of a Prometheus text exposition over its labels.

    ``vllm:num_requests_waiting{model_name="x"} 3`` -> ``{"vllm:num_requests_waiting": 3.0}``.
    """
    values: dict[str, float] = {}
    for name, _, value in prometheus_samples(text):
        values[name] = values.get(name, 0.0) + value
    return values


# --------------------------------------------------------------------------- models

MODELS_PATH = "/v1/models"


def models_url(endpoint: str) -> str:
    """The ``GET /v1/models`` URL of a server given as ``http://host:port`` (``/v1`` suffix allowed)."""
    return endpoint.rstrip("/").removesuffix("/v1") + MODELS_PATH


def served_model_ids(body: bytes | str | Any) -> list[str]:
    """The model ids a ``/v1/models`` answer lists (raw JSON or parsed), first the default one.

    Raises:
        ProtocolError: not an OpenAI model list, or an empty one.
    """
    try:
        data = json.loads(body) if isinstance(body, (bytes, str)) else body
        ids = [str(m["id"]) for m in data["data"]]
    except (ValueError, KeyError, TypeError) as e:
        raise ProtocolError(f"not a model list ({type(e).__name__}: {e})") from None
    if not ids:
        raise ProtocolError("an empty model list")
    return ids


def server_extraction_config(layer_ids: Sequence[int], shared_storage_path: str) -> dict[str, Any]:
    """The two JSON arguments of ``vllm serve`` that turn on extraction, as dicts."""
    return {
        "speculative_config": {
            "method": "extract_hidden_states",
            "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": list(layer_ids)}},
        },
        "kv_transfer_config": {
            "kv_connector": "ExampleHiddenStatesConnector",
            "kv_role": "kv_producer",
            "kv_connector_extra_config": {"shared_storage_path": shared_storage_path},
        },
    }
