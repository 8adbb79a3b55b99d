"""The aiohttp application: vLLM's OpenAI-compatible endpoints with hidden-state extraction.

Field names, status codes and error bodies follow vLLM (see ``docs/serve.md``). Only paths
starting with ``/v1`` need the API key, exactly as vLLM's ``AuthenticationMiddleware``. ``/hsgen/*`` (faults, capacity) exists only with
``ServeConfig.enable_admin``.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import secrets
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from hsgen import protocol
from hsgen.serve.capacity import CapacityModel
from hsgen.serve.config import ServeConfig
from hsgen.serve.engine import Engine, EngineRequest, EngineResult
from hsgen.serve.faults import FaultPlan
from hsgen.serve.hidden import (
    HiddenStateExtractor,
    LoadedModel,
    load_model,
    num_hidden_layers_of,
    resolve_model_path,
)
from hsgen.serve.metrics import render_metrics
from hsgen.serve.writer import HiddenStatesWriter, PendingWrite

log = logging.getLogger(__name__)

STATE_KEY = web.AppKey("hsgen_serve_state", object)


class HTTPError(Exception):
    """Raised by request parsing; becomes vLLM's JSON error body."""

    def __init__(self, status: int, message: str, type_: str = "BadRequestError", param: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type_ = type_
        self.param = param

    def response(self) -> web.Response:
        body = protocol.error_body(self.message, type_=self.type_, code=self.status)
        body["error"]["param"] = self.param
        return web.json_response(body, status=self.status)


@dataclass
class ServerState:
    """Everything the handlers share: config, model, engine, writer, faults."""

    config: ServeConfig
    loaded: LoadedModel
    extractor: HiddenStateExtractor
    max_model_len: int
    engine: Engine | None = None
    writer: HiddenStatesWriter | None = None
    faults: FaultPlan | None = None
    created: int = field(default_factory=lambda: int(time.time()))
    requests_total: int = 0


def build_state(config: ServeConfig, loaded: LoadedModel | None = None) -> ServerState:
    """Load the model (unless given) and check the configuration against it."""
    config.validate()
    if loaded is None:
        path = resolve_model_path(config.model, config.tiny_cache_dir, config.revision)
        protocol.normalize_layer_ids(
            config.layer_ids, num_hidden_layers_of(path)
        )  # fail before loading weights
        loaded = load_model(
            str(path), dtype=config.dtype, device=config.device, tiny_cache_dir=config.tiny_cache_dir
        )
    extractor = HiddenStateExtractor(loaded, config.layer_ids)
    max_model_len = config.max_model_len or loaded.max_position_embeddings or 2048
    if loaded.max_position_embeddings and max_model_len > loaded.max_position_embeddings:
        raise ValueError(
            f"--max-model-len {max_model_len} exceeds the model's max_position_embeddings "
            f"{loaded.max_position_embeddings} ({loaded.path / 'config.json'})"
        )
    os.makedirs(config.shared_storage_path, exist_ok=True)
    return ServerState(config, loaded, extractor, max_model_len, faults=config.faults)


def create_app(state: ServerState) -> web.Application:
    """The aiohttp application for ``state``; the engine starts with the app."""
    app = web.Application(middlewares=[_error_middleware, _auth_middleware], client_max_size=256 << 20)
    app[STATE_KEY] = state
    app.router.add_get("/health", health)
    app.router.add_get("/ping", health)
    app.router.add_get("/version", version)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/chat/completions/render", chat_render)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)
    if state.config.enable_admin:
        app.router.add_get("/hsgen/faults", get_faults)
        app.router.add_put("/hsgen/faults", put_faults)
        app.router.add_put("/hsgen/capacity", put_capacity)
    app.on_startup.append(_startup)
    app.on_cleanup.append(_cleanup)
    return app


async def _startup(app: web.Application) -> None:
    state: ServerState = app[STATE_KEY]
    cfg = state.config
    state.engine = Engine(
        state.extractor,
        max_num_seqs=cfg.max_num_seqs,
        max_num_batched_tokens=cfg.max_num_batched_tokens,
        capacity=cfg.capacity,
        torch_threads=cfg.torch_threads,
    )
    state.engine.start()
    state.writer = HiddenStatesWriter(
        use_lock=cfg.behaviour.use_lock, num_threads=cfg.num_writer_threads, capacity=cfg.capacity
    )
    log.info(
        "serving %s (layers %s, vLLM %s behaviour) writing to %s",
        cfg.model_name,
        state.extractor.layer_ids,
        cfg.behaviour.version,
        cfg.shared_storage_path,
    )


async def _cleanup(app: web.Application) -> None:
    state: ServerState = app[STATE_KEY]
    if state.engine is not None:
        await state.engine.stop()
    if state.writer is not None:
        await asyncio.get_running_loop().run_in_executor(None, state.writer.close)
    state.extractor.close()


@web.middleware
async def _error_middleware(request: web.Request, handler):
    try:
        return await handler(request)
    except HTTPError as e:
        return e.response()
    except web.HTTPException as e:
        if e.status == 404:
            return HTTPError(404, f"Not Found: {request.path}", "NotFoundError").response()
        if e.status == 405:
            return HTTPError(
                405, f"Method Not Allowed: {request.method} {request.path}", "MethodNotAllowed"
            ).response()
        raise
    except asyncio.CancelledError:
        raise
    except Exception as e:
        log.exception("internal error on %s", request.path)
        return HTTPError(500, f"{type(e).__name__}: {e}", "InternalServerError").response()


GUARDED_PREFIX = "/v1"
"""With an API key, vLLM 0.18-0.33 requires it on paths starting with this and no others: /health,
/ping, /version, /metrics, /tokenize and /detokenize answer without it (docs/serve.md)."""


def bearer_matches(authorization: str, key: str) -> bool:
    """vLLM's check: scheme ``Bearer`` (any case), token compared in constant time."""
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() != "bearer":
        return False
    return secrets.compare_digest(
        hashlib.sha256(token.encode()).digest(), hashlib.sha256(key.encode()).digest()
    )


@web.middleware
async def _auth_middleware(request: web.Request, handler):
    key = request.app[STATE_KEY].config.api_key
    needs_key = key and request.method != "OPTIONS" and request.path.startswith(GUARDED_PREFIX)
    if needs_key and not bearer_matches(request.headers.get("Authorization", ""), key):
        return web.json_response({"error": "Unauthorized"}, status=401)
    return await handler(request)


# --------------------------------------------------------------------------- small endpoints


async def health(request: web.Request) -> web.Response:
    return web.Response(status=200)


async def version(request: web.Request) -> web.Response:
    return web.json_response({"version": request.app[STATE_KEY].config.behaviour.version})


async def metrics(request: web.Request) -> web.Response:
    state: ServerState = request.app[STATE_KEY]
    text = render_metrics(state)
    return web.Response(text=text, content_type="text/plain", charset="utf-8")


async def models(request: web.Request) -> web.Response:
    state: ServerState = request.app[STATE_KEY]
    name = state.config.model_name
    card = {
        "id": name,
        "object": "model",
        "created": state.created,
        "owned_by": "vllm",
        "root": str(state.config.model),
        "parent": None,
        "max_model_len": state.max_model_len,
        "permission": [
            {
                "id": f"modelperm-{uuid.uuid4().hex}",
                "object": "model_permission",
                "created": state.created,
                "allow_create_engine": False,
                "allow_sampling": True,
                "allow_logprobs": True,
                "allow_search_indices": False,
                "allow_view": True,
                "allow_fine_tuning": False,
                "organization": "*",
                "group": None,
                "is_blocking": False,
            }
        ],
    }
    return web.json_response({"object": "list", "data": [card]})


# --------------------------------------------------------------------------- request parsing


async def _json_body(request: web.Request) -> dict[str, Any]:
    try:
        body = await request.json()
    except Exception as e:
        raise HTTPError(400, f"request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise HTTPError(400, "request body must be a JSON object")
    return body


def _check_model(state: ServerState, body: dict[str, Any]) -> None:
    model = body.get("model")
    if model is not None and model != state.config.model_name:
        raise HTTPError(404, f"The model `{model}` does not exist.", "NotFoundError", "model")


def _int_field(body: dict[str, Any], name: str, default: int | None, minimum: int) -> int | None:
    value = body.get(name, default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise HTTPError(400, f"{name} must be an integer, got {value!r}", param=name)
    if value < minimum:
        raise HTTPError(400, f"{name} must be at least {minimum}, got {value}.", param=name)
    return value


def _bool_field(body: dict[str, Any], name: str, default: bool) -> bool:
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise HTTPError(400, f"{name} must be a boolean, got {value!r}", param=name)
    return value


def _common_checks(body: dict[str, Any]) -> None:
    if body.get("stream"):
        raise HTTPError(400, "stream=true is not supported by hsgen serve; send stream=false", param="stream")
    n = _int_field(body, "n", 1, 1)
    if n != 1:
        raise HTTPError(400, f"n={n} is not supported by hsgen serve; extraction uses n=1", param="n")


def _validate_prompt(state: ServerState, ids: list[int], max_tokens: int | None) -> int:
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


def _tokenize_text(state: ServerState, text: str, add_special_tokens: bool) -> list[int]:
    return list(state.loaded.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])


def _completion_prompts(state: ServerState, body: dict[str, Any]) -> list[list[int]]:
    prompt = body.get("prompt")
    add_special = _bool_field(body, "add_special_tokens", True)
    if prompt is None:
        raise HTTPError(400, "Either prompt or prompt_embeds must be provided and non-empty.", param="prompt")
    if isinstance(prompt, str):
        return [_tokenize_text(state, prompt, add_special)]
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
            out.append(_tokenize_text(state, p, add_special))
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


def _render_chat(state: ServerState, body: dict[str, Any]) -> tuple[str, list[int]]:
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
    add_gen = _bool_field(body, "add_generation_prompt", True)
    cont = _bool_field(body, "continue_final_message", False)
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
    ids = _tokenize_text(state, text, _bool_field(body, "add_special_tokens", False))
    return text, ids


def _kv_params(state: ServerState, body: dict[str, Any]) -> tuple[bool, str | None]:
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


def _base_request_id(request: web.Request) -> str | None:
    rid = request.headers.get("X-Request-Id")
    if rid is None:
        return None
    try:
        return protocol.check_request_id(rid)
    except ValueError as e:
        raise HTTPError(400, str(e)) from None


# --------------------------------------------------------------------------- extraction


@dataclass
class _Job:
    prompt_token_ids: list[int]
    path: str
    fault: str | None = None
    pending: PendingWrite | None = None
    result: EngineResult | None = None


async def _run_jobs(
    request: web.Request,
    state: ServerState,
    jobs: list[_Job],
    max_tokens: list[int],
    body: dict[str, Any],
    include: bool,
) -> None:
    """Run the jobs through the engine, taking each file's lock before the forward ends."""
    ignore_eos = _bool_field(body, "ignore_eos", False)
    assert state.engine is not None and state.writer is not None
    writer = state.writer
    try:
        for job in jobs:
            job.pending = writer.prepare(job.path)
        results = await asyncio.gather(
            *(
                state.engine.generate(EngineRequest(job.prompt_token_ids, mt, ignore_eos, include))
                for job, mt in zip(jobs, max_tokens, strict=True)
            )
        )
    except BaseException as e:
        if isinstance(e, asyncio.CancelledError):  # the client went away: vLLM aborts the request
            state.engine.stats.finished["abort"] += 1
        for job in jobs:
            if job.pending is not None:
                writer.abandon(job.pending)
        raise
    for job, res in zip(jobs, results, strict=True):
        job.result = res
    mode = state.config.behaviour.write_mode
    if mode == "sync":
        loop = asyncio.get_running_loop()
        for job in jobs:
            await loop.run_in_executor(None, _write_job, writer, job)
    elif mode == "pool":
        for job in jobs:
            writer.submit(job.pending, job.result.hidden_states, job.result.hidden_token_ids, job.fault)


def _write_job(writer: HiddenStatesWriter, job: _Job) -> None:
    assert job.pending is not None and job.result is not None
    writer.write(job.pending, job.result.hidden_states, job.result.hidden_token_ids, job.fault)


async def _respond(
    request: web.Request, state: ServerState, body: dict[str, Any], jobs: list[_Job]
) -> web.StreamResponse:
    """Send the response; in the 0.24+ row, start the writes only after it is sent."""
    resp = web.json_response(body)
    if state.config.behaviour.write_mode != "after_response":
        return resp
    assert state.writer is not None
    try:
        await resp.prepare(request)
        await resp.write_eof()
    finally:
        for job in jobs:
            state.writer.submit(job.pending, job.result.hidden_states, job.result.hidden_token_ids, job.fault)
    return resp


async def _pre_fault(state: ServerState) -> str | None:
    fault = state.faults.draw() if state.faults is not None else None
    if fault == "http_500":
        log.warning("fault injection: HTTP 500")
        raise HTTPError(500, "fault injection: internal server error", "InternalServerError")
    if fault == "hang":
        log.warning("fault injection: hanging for %.0f s", state.faults.hang_s)
        await asyncio.sleep(state.faults.hang_s)
    return fault


def _usage(jobs: list[_Job]) -> dict[str, Any]:
    prompt = sum(len(j.prompt_token_ids) for j in jobs)
    completion = sum(len(j.result.output_token_ids) for j in jobs)
    return {
        "prompt_tokens": prompt,
        "total_tokens": prompt + completion,
        "completion_tokens": completion,
        "prompt_tokens_details": None,
    }


def _decode(state: ServerState, ids: list[int]) -> str:
    return state.loaded.tokenizer.decode(ids, skip_special_tokens=True)


async def completions(request: web.Request) -> web.StreamResponse:
    state: ServerState = request.app[STATE_KEY]
    body = await _json_body(request)
    _check_model(state, body)
    _common_checks(body)
    prompts = _completion_prompts(state, body)
    requested = _int_field(body, "max_tokens", 16, 1)
    max_tokens = [_validate_prompt(state, p, requested) for p in prompts]
    include, custom = _kv_params(state, body)
    return_ids = _bool_field(body, "return_token_ids", False)
    request_id = protocol.completion_request_id(_base_request_id(request))
    state.requests_total += 1
    fault = await _pre_fault(state)
    jobs = []
    for i, p in enumerate(prompts):
        name = protocol.hidden_states_filename(request_id, i)
        path = custom if (custom and i == 0) else os.path.join(state.config.shared_storage_path, name)
        jobs.append(_Job(p, path, fault if i == 0 else None))
    await _run_jobs(request, state, jobs, max_tokens, body, include)
    choices = []
    for i, job in enumerate(jobs):
        choice: dict[str, Any] = {
            "index": i,
            "text": _decode(state, job.result.output_token_ids),
            "logprobs": None,
            "finish_reason": job.result.finish_reason,
            "stop_reason": None,
            "prompt_logprobs": None,
        }
        if return_ids:
            choice["prompt_token_ids"] = job.prompt_token_ids
            choice["token_ids"] = job.result.output_token_ids
        choices.append(choice)
    out = {
        "id": request_id,
        "object": "text_completion",
        "created": int(time.time()),
        "model": state.config.model_name,
        "choices": choices,
        "service_tier": None,
        "system_fingerprint": None,
        "usage": _usage(jobs),
        "kv_transfer_params": {"hidden_states_path": jobs[0].path},
    }
    return await _respond(request, state, out, jobs)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    state: ServerState = request.app[STATE_KEY]
    body = await _json_body(request)
    _check_model(state, body)
    _common_checks(body)
    _, ids = _render_chat(state, body)
    requested = _int_field(body, "max_completion_tokens", None, 1)
    if requested is None:
        requested = _int_field(body, "max_tokens", None, 1)
    max_tokens = _validate_prompt(state, ids, requested)
    include, custom = _kv_params(state, body)
    return_ids = _bool_field(body, "return_token_ids", False)
    base = _base_request_id(request) or uuid.uuid4().hex[:16]
    request_id = f"chatcmpl-{base}"
    state.requests_total += 1
    fault = await _pre_fault(state)
    path = custom or os.path.join(
        state.config.shared_storage_path, f"{request_id}-{uuid.uuid4().hex[:8]}.safetensors"
    )
    jobs = [_Job(ids, path, fault)]
    await _run_jobs(request, state, jobs, [max_tokens], body, include)
    res = jobs[0].result
    choice: dict[str, Any] = {
        "index": 0,
        "message": {"role": "assistant", "content": _decode(state, res.output_token_ids), "tool_calls": []},
        "logprobs": None,
        "finish_reason": res.finish_reason,
        "stop_reason": None,
    }
    if return_ids:
        choice["token_ids"] = res.output_token_ids
    out = {
        "id": request_id,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": state.config.model_name,
        "choices": [choice],
        "service_tier": None,
        "system_fingerprint": None,
        "usage": _usage(jobs),
        "prompt_logprobs": None,
        "prompt_token_ids": ids if return_ids else None,
        "kv_transfer_params": {"hidden_states_path": path},
    }
    return await _respond(request, state, out, jobs)


async def chat_render(request: web.Request) -> web.Response:
    state: ServerState = request.app[STATE_KEY]
    body = await _json_body(request)
    _check_model(state, body)
    text, ids = _render_chat(state, body)
    return web.json_response(
        {
            "request_id": f"chatcmpl-{uuid.uuid4().hex[:16]}",
            "model": state.config.model_name,
            "prompt": text,
            "token_ids": ids,
        }
    )


async def tokenize(request: web.Request) -> web.Response:
    state: ServerState = request.app[STATE_KEY]
    body = await _json_body(request)
    _check_model(state, body)
    if "messages" in body:
        body.setdefault("add_generation_prompt", True)
        _, ids = _render_chat(state, body)
    else:
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            raise HTTPError(400, "tokenize needs a string prompt or messages", param="prompt")
        ids = _tokenize_text(state, prompt, _bool_field(body, "add_special_tokens", True))
    strs = None
    if _bool_field(body, "return_token_strs", False):
        strs = state.loaded.tokenizer.convert_ids_to_tokens(ids)
    return web.json_response(
        {"count": len(ids), "max_model_len": state.max_model_len, "tokens": ids, "token_strs": strs}
    )


async def detokenize(request: web.Request) -> web.Response:
    state: ServerState = request.app[STATE_KEY]
    body = await _json_body(request)
    _check_model(state, body)
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
        raise HTTPError(400, "tokens must be a list of integer token ids", param="tokens")
    return web.json_response({"prompt": state.loaded.tokenizer.decode(tokens)})


# --------------------------------------------------------------------------- admin (tests)


async def get_faults(request: web.Request) -> web.Response:
    state: ServerState = request.app[STATE_KEY]
    plan = state.faults
    return web.json_response(
        {"plan": plan.to_text() if plan else "", "injected": dict(plan.injected) if plan else {}}
    )


async def put_faults(request: web.Request) -> web.Response:
    state: ServerState = request.app[STATE_KEY]
    body = await _json_body(request)
    text = body.get("plan") or ""
    try:
        state.faults = FaultPlan.parse(text) if text else None
    except ValueError as e:
        raise HTTPError(400, str(e)) from None
    return await get_faults(request)


async def put_capacity(request: web.Request) -> web.Response:
    state: ServerState = request.app[STATE_KEY]
    body = await _json_body(request)
    text = body.get("capacity") or ""
    try:
        cap = CapacityModel.parse(text) if text else None
    except (ValueError, TypeError) as e:
        raise HTTPError(400, str(e)) from None
    state.config.capacity = cap
    if state.engine is not None:
        state.engine.capacity = cap
    if state.writer is not None:
        state.writer.capacity = cap
    return web.json_response({"capacity": cap.to_text() if cap else ""})
