"""The wire contract with vLLM, below client and server alike: request bodies, responses, hidden-state
files, locks, layer ids (:mod:`~hsgen.protocol.extraction`) and ``prompt_logprobs``
(:mod:`~hsgen.protocol.prompt_logprobs`).

The names of the module this folder was (``hsgen.protocol``) stay importable from it.
"""

from __future__ import annotations

from hsgen._moved import forward

__all__ = [
    "LOCK_SUFFIX",
    "DEFAULT_SHARED_STORAGE_PATH",
    "HIDDEN_STATES_KEY",
    "TOKEN_IDS_KEY",
    "SAFETENSORS_DTYPES",
    "LOGICAL_TO_SAFETENSORS",
    "ProtocolError",
    "completion_request",
    "chat_request",
    "check_request_id",
    "redact_url",
    "check_no_credentials",
    "auth_headers",
    "ExtractionResult",
    "parse_extraction_response",
    "error_body",
    "context_length_message",
    "EMPTY_PROMPT_MESSAGE",
    "completion_request_id",
    "hidden_states_filename",
    "lock_path",
    "is_within",
    "TensorInfo",
    "read_safetensors_header",
    "safetensors_header_bytes",
    "default_eagle3_layer_ids",
    "default_dflash_layer_ids",
    "normalize_layer_ids",
    "parse_layer_ids",
    "parse_prometheus",
    "server_extraction_config",
]

__getattr__ = forward("hsgen.protocol.extraction", __all__)
