"""Request parsing like vLLM's: JSON bodies, typed fields, prompts (text, token ids, chat
messages through the chat template), their limits, ``kv_transfer_params`` and ``X-Request-Id``.
Every refusal is an :class:`~hsgen.serve.state.HTTPError` with vLLM's status and message."""

from __future__ import annotations

import logging
import os
from typing import Any

from aiohttp import web

from hsgen import protocol
from hsgen.serve.state import HTTPError, ServerState

log = logging.getLogger(__name__)


async def json_body(request: web.Request) -> dict[str, Any]:
    try:
        body = await request.json()
    except Exception as e:
        raise HTTPError(400, f"request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise HTTPError(400, "request body must be a JSON object")
    return body


def check_model(state: ServerState, body: dict[str, Any]) -> None:
    model = body.get("model")
    if model is not None and model != state.config.model_name:
        raise HTTPError(404, f"The model `{model}` does not exist.", "NotFoundError", "model")


def int_field(body: dict[str, Any], name: str, default: int | None, minimum: int) -> int | None:
    value = body.get(name, default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise HTTPError(400, f"{name} must be an integer, got {value!r}", param=name)
    if value < minimum:
        raise HTTPError(400, f"{name} must be at least {minimum}, got {value}.", param=name)
    return value


def bool_field(body: dict[str, Any], name: str, default: bool) -> bool:
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise HTTPError(400, f"{name} must be a boolean, got {value!r}", param=name)
    return value


def common_checks(body: dict[str, Any]) -> None:
    if body.get("stream"):
        raise HTTPError(400, "stream=true is not supported by hsgen serve; send stream=false", param="stream")
    n = int_field(body, "n", 1, 1)
    if n != 1:
        raise HTTPError(400, f"n={n} is not supported by hsgen serve; extraction uses n=1", param="n")


def validate_prompt(state: ServerState, ids: list[int], max_tokens: int | None) -> int:
    """Check a tokenized prompt like vLLM; return the effective ``max_tokens``."""
    if not ids:
        raise HTTPError(400, protocol.EMPTY_PROMPT_MESSAGE)
    vocab = state.loaded.vocab_size
    bad = [t for t in ids if not 0 <= t < vocab]
    if bad:
        raise HTTPError(400, f"Token id {bad[0]} is out of vocabulary (vocab size {vocab})", param="prompt")
    n, max_len = len(ids), state.max_model_len
    if n >= max_len:
        raise HTTPError(400, protocol.context_length_message(max_len, n))
    if max_tokens is None:
        return max_len - n
    if n + max_tokens > max_len:
        raise HTTPError(
            400,
            f"'max_tokens' or 'max_completion_tokens' is too large: {max_tokens}. This model's maximum "
            f"context length is {max_len} tokens and your request has {n} input tokens "
            f"({max_tokens} > {max_len} - {n}).",
            param="max_tokens",
        )
    return max_tokens


def tokenize_text(state: ServerState, text: str, add_special_tokens: bool) -> list[int]:
    return list(state.loaded.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])


def completion_prompts(state: ServerState, body: dict[str, Any]) -> list[list[int]]:
    prompt = body.get("prompt")
    add_special = bool_field(body, "add_special_tokens", True)
    if prompt is None:
        raise HTTPError(400, "Either prompt or prompt_embeds must be provided and non-empty.", param="prompt")
    if isinstance(prompt, str):
        return [tokenize_text(state, prompt, add_special)]
    if not isinstance(prompt, list):
        raise HTTPError(
            400, "prompt must be a string, a list of token ids, or a list of those", param="prompt"
        )
    if not prompt:
        raise HTTPError(400, protocol.EMPTY_PROMPT_MESSAGE)
    if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return [list(prompt)]
    out = []
    for i, p in enumerate(prompt):
        if isinstance(p, str):
            out.append(tokenize_text(state, p, add_special))
        elif isinstance(p, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
            out.append(list(p))
        else:
            raise HTTPError(
                400, f"prompt[{i}] must be a string or a list of integer token ids", param="prompt"
            )
    return out


def _flatten_content(content: Any, where: str) -> Any:
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if (
                not isinstance(part, dict)
                or part.get("type") != "text"
                or not isinstance(part.get("text"), str)
            ):
                raise HTTPError(400, f"{where}.content[{j}]: only text parts are supported", param="messages")
            parts.append(part["text"])
        return "\n".join(parts)
    return content


def render_chat(state: ServerState, body: dict[str, Any]) -> tuple[str, list[int]]:
    """Apply the tokenizer's chat template like vLLM; returns (text, token ids)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise HTTPError(400, "messages must be a non-empty list of {role, content} objects", param="messages")
    clean = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m:
            raise HTTPError(400, f"messages[{i}] must be an object with a role", param="messages")
        m = dict(m)
        m["content"] = _flatten_content(m.get("content") or "", f"messages[{i}]")
        clean.append(m)
    add_gen = bool_field(body, "add_generation_prompt", True)
    cont = bool_field(body, "continue_final_message", False)
    if add_gen and cont:
        raise HTTPError(400, "Cannot set both `continue_final_message` and `add_generation_prompt` to True.")
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise HTTPError(400, "chat_template_kwargs must be an object", param="chat_template_kwargs")
    tok = state.loaded.tokenizer
    try:
        text = tok.apply_chat_template(
            clean,
            tokenize=False,
            add_generation_prompt=add_gen,
            continue_final_message=cont,
            **{
                k: v
                for k, v in kwargs.items()
                if k not in ("add_generation_prompt", "continue_final_message")
            },
        )
    except Exception as e:
        raise HTTPError(400, f"chat template failed: {e}", param="messages") from None
    ids = tokenize_text(state, text, bool_field(body, "add_special_tokens", False))
    return text, ids


def kv_params(state: ServerState, body: dict[str, Any]) -> tuple[bool, str | None]:
    """(include_output_tokens, custom path) from top-level ``kv_transfer_params``, like vLLM."""
    params = body.get("kv_transfer_params")
    if params is None:
        return False, None
    if not isinstance(params, dict):
        raise HTTPError(400, "kv_transfer_params must be an object", param="kv_transfer_params")
    beh = state.config.behaviour
    include = bool(params.get("include_output_tokens", False))
    if include and not beh.supports_output_tokens:
        log.warning("include_output_tokens needs vLLM >= 0.24 (imitating %s): ignored", beh.version)
        include = False
    path = params.get("hidden_states_path")
    if path is not None:
        if not (beh.supports_custom_save_path and state.config.allow_custom_save_path):
            log.warning("kv_transfer_params.hidden_states_path ignored: allow_custom_save_path is not set")
            path = None
        elif not isinstance(path, str) or not path:
            raise HTTPError(400, "kv_transfer_params.hidden_states_path must be a path string")
        elif not os.path.isabs(path):
            path = os.path.join(state.config.shared_storage_path, path)
    return include, path


def base_request_id(request: web.Request) -> str | None:
    rid = request.headers.get("X-Request-Id")
    if rid is None:
        return None
    try:
        return protocol.check_request_id(rid)
    except ValueError as e:
        raise HTTPError(400, str(e)) from None
