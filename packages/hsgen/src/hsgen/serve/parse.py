"""Request parsing like vLLM's: JSON bodies, typed fields, prompts (text, token ids, chat
messages through the chat template), their limits, ``kv_transfer_params`` and ``X-Request-Id``.
Every refusal is an :class:`~hsgen.serve.state.HTTPError` with vLLM's status and message."""

from __future__ import annotations

import json
import logging
import os
from typing import Any

from aiohttp import web

from hsgen.protocol import extraction as protocol
from hsgen.serve.state import HTTPError, ServerState

log = logging.getLogger(__name__)

NO_PROMPT_MESSAGE = "Either prompt or prompt_embeds must be provided and non-empty."


def _summary(value: Any) -> Any:
    """vLLM's size-bounded stand-in for a validation error's ``input``."""
    if isinstance(value, list | dict):
        return f"<{type(value).__name__} of {len(value)} items>"
    return value


def request_validation_error(error: dict[str, Any], param: str | None) -> HTTPError:
    """The 400 vLLM answers when FastAPI / pydantic refuse the body: type ``Bad Request`` and the
    error printed as vLLM's handler prints pydantic's (``1 validation error:\n  {...}``)."""
    error = {**error, "input": _summary(error.get("input"))}
    return HTTPError(400, f"1 validation error:\n  {error!r}", "Bad Request", param)


async def json_body(request: web.Request) -> dict[str, Any]:
    """The JSON object of the body; refused as vLLM's FastAPI app refuses it."""
    raw = await request.read()
    if not raw.strip():
        raise request_validation_error({"type": "missing", "loc": "body", "msg": "Field required", "input": None},
                                       "body")  # fmt: skip
    try:
        body = json.loads(raw)
    except json.JSONDecodeError as e:
        raise request_validation_error({"type": "json_invalid", "loc": f"body.{e.pos}", "msg": "JSON decode error",
                                        "input": {}, "ctx": {"error": e.msg}}, f"body.{e.pos}") from None  # fmt: skip
    except UnicodeDecodeError as e:
        raise HTTPError(400, f"request body is not UTF-8: {e}") from None
    if not isinstance(body, dict):
        msg = "Input should be a valid dictionary or object to extract fields from"
        raise request_validation_error({"type": "model_attributes_type", "loc": "body", "msg": msg, "input": body},
                                       "body")  # fmt: skip
    return body


def validation_message(message: str, parameter: str | None = None, value: Any = None) -> str:
    """``message`` as vLLM's ``VLLMValidationError`` prints it: `` (parameter=..., value=...)`` appended."""
    extras = [f"{k}={v}" for k, v in (("parameter", parameter), ("value", value)) if v is not None]
    return f"{message} ({', '.join(extras)})" if extras else message


def check_model(state: ServerState, body: dict[str, Any]) -> None:
    model = body.get("model")
    if model and model != state.config.model_name:
        message = f"The model `{model}` does not exist. Valid aliases: {state.config.model_name}."
        raise HTTPError(404, message, "NotFoundError", "model")


def int_field(body: dict[str, Any], name: str, default: int | None, minimum: int) -> int | None:
    value = body.get(name, default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise HTTPError(400, f"{name} must be an integer, got {value!r}", param=name)
    if value < minimum:
        raise HTTPError(400, validation_message(f"{name} must be at least {minimum}, got {value}.", name, value),
                        param=name)  # fmt: skip
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


def check_max_tokens(state: ServerState, requested: int | None, param: str = "max_tokens") -> None:
    """vLLM refuses a request for more output tokens than the whole context holds."""
    max_len = state.max_model_len
    if requested is not None and requested > max_len:
        message = (f"{param}={requested} cannot be greater than max_model_len={max_len}. "
                   "Please request fewer output tokens.")  # fmt: skip
        raise HTTPError(400, validation_message(message, param, requested), param=param)


def validate_prompt(
    state: ServerState, ids: list[int], max_tokens: int | None, *, from_text: bool = False
) -> int:
    """Check a tokenized prompt like vLLM 0.32; return the effective ``max_tokens``.

    In vLLM's order: a prompt over ``max_model_len`` (a text prompt is tokenized only up to one
    token past it, so its count reads "at least"), one that leaves no room for a token
    (``max_tokens`` clamped to 0), an empty one, then token ids out of vocabulary. A
    ``max_tokens`` that does not fit after the prompt is clamped, as vLLM does.
    """
    n, max_len = len(ids), state.max_model_len
    if n > max_len:
        counted = min(n, max_len + 1) if from_text else n
        message = protocol.context_length_message(max_len, counted, at_least=counted == max_len + 1)
        raise HTTPError(400, validation_message(message, "input_tokens", counted), param="input_tokens")
    effective = max_len - n if max_tokens is None else min(max_tokens, max_len - n)
    if effective < 1:
        message = validation_message(
            f"max_tokens must be at least 1, got {effective}.", "max_tokens", effective
        )
        raise HTTPError(400, message, param="max_tokens")
    if not ids:
        raise HTTPError(400, protocol.EMPTY_PROMPT_MESSAGE)
    top = max(len(state.loaded.tokenizer) - 1, state.loaded.vocab_size - 1)
    low, high = min(ids), max(ids)
    if low < 0 or high > top:
        raise HTTPError(400, f"Token id {low if low < 0 else high} is out of vocabulary")
    return effective


def tokenize_text(state: ServerState, text: str, add_special_tokens: bool) -> list[int]:
    return list(state.loaded.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])


def completion_prompts(state: ServerState, body: dict[str, Any]) -> list[tuple[list[int], bool]]:
    """The prompts of a completion request as ``(token ids, whether given as text)``."""
    prompt = body.get("prompt")
    add_special = bool_field(body, "add_special_tokens", True)
    if prompt is None or prompt == "":
        raise HTTPError(400, validation_message(NO_PROMPT_MESSAGE, "prompt"), param="prompt")
    if isinstance(prompt, str):
        return [(tokenize_text(state, prompt, add_special), True)]
    if not isinstance(prompt, list):
        raise HTTPError(
            400, "prompt must be a string, a list of token ids, or a list of those", param="prompt"
        )
    if not prompt:
        raise HTTPError(400, "You must pass at least one prompt")
    if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return [(list(prompt), False)]
    out = []
    for i, p in enumerate(prompt):
        if isinstance(p, str):
            out.append((tokenize_text(state, p, add_special), True))
        elif isinstance(p, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
            out.append((list(p), False))
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


def chat_prompt(state: ServerState, body: dict[str, Any]) -> tuple[list[int], int]:
    """A chat request's prompt token ids and its effective ``max_tokens`` (``max_completion_tokens``
    first), checked as vLLM checks them."""
    requested, param = int_field(body, "max_completion_tokens", None, 1), "max_completion_tokens"
    if requested is None:
        requested, param = int_field(body, "max_tokens", None, 1), "max_tokens"
    check_max_tokens(state, requested, param)
    _, ids = render_chat(state, body)
    return ids, validate_prompt(state, ids, requested, from_text=True)


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
    """``X-Request-Id`` as vLLM takes it: any text (a ``/`` in it makes a subdirectory of the shared
    directory, see :func:`shared_path`)."""
    return request.headers.get("X-Request-Id")


def shared_path(state: ServerState, name: str) -> str:
    """``name`` in the shared directory, as vLLM joins it (a ``/`` makes subdirectories). Unlike
    vLLM, a name whose ``..`` parts lead out of the directory is refused (400)."""
    root = os.path.normpath(state.config.shared_storage_path)
    path = os.path.join(root, name)
    if os.path.commonpath([root, os.path.normpath(path)]) != root:
        raise HTTPError(400, f"X-Request-Id: {name!r} would name a file outside the shared directory: "
                             "hsgen serve refuses '..' parts that lead out of it")  # fmt: skip
    return path
