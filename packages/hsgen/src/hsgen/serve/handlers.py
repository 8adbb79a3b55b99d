"""The route handlers: vLLM's OpenAI-compatible endpoints, the small ones (health, version,
metrics, models) and the test-only ``/hsgen/*`` admin endpoints."""

from __future__ import annotations

import time
import uuid
from typing import Any

from aiohttp import web

from hsgen.protocol import extraction as protocol
from hsgen.serve.capacity import CapacityModel
from hsgen.serve.extraction import (
    Job,
    decode,
    pre_fault,
    prompt_logprobs_field,
    prompt_logprobs_json,
    respond,
    run_jobs,
    usage,
)
from hsgen.serve.faults import FaultPlan
from hsgen.serve.metrics import render_metrics
from hsgen.serve.parse import (
    base_request_id,
    bool_field,
    chat_prompt,
    check_max_tokens,
    check_model,
    common_checks,
    completion_prompts,
    int_field,
    json_body,
    kv_params,
    render_chat,
    shared_path,
    tokenize_text,
    validate_prompt,
)
from hsgen.serve.state import STATE_KEY, HTTPError, ServerState


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


async def completions(request: web.Request) -> web.StreamResponse:
    state: ServerState = request.app[STATE_KEY]
    body = await json_body(request)
    check_model(state, body)
    common_checks(body)
    requested = int_field(body, "max_tokens", 16, 1)
    check_max_tokens(state, requested)
    given = completion_prompts(state, body)
    max_tokens = [validate_prompt(state, p, requested, from_text=text) for p, text in given]
    prompts = [p for p, _ in given]
    include, custom = kv_params(state, body)
    return_ids = bool_field(body, "return_token_ids", False)
    want_logprobs = prompt_logprobs_field(body)
    request_id = protocol.completion_request_id(base_request_id(request))
    paths = [shared_path(state, protocol.hidden_states_filename(request_id, i)) for i in range(len(prompts))]
    if custom:
        paths[0] = custom
    state.requests_total += 1
    fault = await pre_fault(state)
    jobs = [
        Job(p, path, fault if i == 0 else None)
        for i, (p, path) in enumerate(zip(prompts, paths, strict=True))
    ]
    await run_jobs(request, state, jobs, max_tokens, body, include, want_logprobs)
    choices = []
    for i, job in enumerate(jobs):
        choice: dict[str, Any] = {
            "index": i,
            "text": decode(state, job.result.output_token_ids),
            "logprobs": None,
            "finish_reason": job.result.finish_reason,
            "stop_reason": None,
            "token_ids": job.result.output_token_ids if return_ids else None,
            "prompt_logprobs": prompt_logprobs_json(state, job),
            "prompt_token_ids": job.prompt_token_ids if return_ids else None,
            "routed_experts": None,
        }
        choices.append(choice)
    out = {
        "id": request_id,
        "object": "text_completion",
        "created": int(time.time()),
        "model": state.config.model_name,
        "choices": choices,
        "service_tier": None,
        "system_fingerprint": None,
        "usage": usage(jobs),
        "kv_transfer_params": {"hidden_states_path": jobs[0].path},
        "ec_transfer_params": None,
        "metrics": None,
    }
    return await respond(request, state, out, jobs)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    state: ServerState = request.app[STATE_KEY]
    body = await json_body(request)
    check_model(state, body)
    common_checks(body)
    ids, max_tokens = chat_prompt(state, body)
    include, custom = kv_params(state, body)
    return_ids = bool_field(body, "return_token_ids", False)
    base = base_request_id(request) or uuid.uuid4().hex[:16]
    request_id = f"chatcmpl-{base}"
    path = custom or shared_path(state, f"{request_id}-{uuid.uuid4().hex[:8]}.safetensors")
    state.requests_total += 1
    fault = await pre_fault(state)
    jobs = [Job(ids, path, fault)]
    await run_jobs(request, state, jobs, [max_tokens], body, include)
    res = jobs[0].result
    message = {"role": "assistant", "content": decode(state, res.output_token_ids), "refusal": None,
               "annotations": None, "audio": None, "function_call": None, "reasoning": None}  # fmt: skip
    choice: dict[str, Any] = {
        "index": 0,
        "message": message,
        "logprobs": None,
        "finish_reason": res.finish_reason,
        "stop_reason": None,
        "token_ids": res.output_token_ids if return_ids else None,
        "routed_experts": None,
    }
    out = {
        "id": request_id,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": state.config.model_name,
        "choices": [choice],
        "service_tier": None,
        "system_fingerprint": None,
        "usage": usage(jobs),
        "prompt_logprobs": None,
        "prompt_token_ids": ids if return_ids else None,
        "prompt_text": None,
        "kv_transfer_params": {"hidden_states_path": path},
        "ec_transfer_params": None,
        "metrics": None,
    }
    return await respond(request, state, out, jobs)


SCALE_OUT_DISABLED = (
    "Scale-out endpoints are disabled. Restart vllm serve with --enable-scale-out to enable them."
)
"""vLLM's 403 message for its render endpoints without ``--enable-scale-out`` (hsgen serve has the flag too)."""


async def chat_render(request: web.Request) -> web.Response:
    """vLLM's ``/v1/chat/completions/render``: the chat request rendered to the token ids and
    sampling parameters the engine would get (vLLM's ``GenerateRequest``), without the model."""
    state: ServerState = request.app[STATE_KEY]
    if not state.config.enable_scale_out:
        raise HTTPError(403, SCALE_OUT_DISABLED, "PermissionDeniedError")
    body = await json_body(request)
    check_model(state, body)
    ids, max_tokens = chat_prompt(state, body)
    return web.json_response(generate_request(state, body, request, ids, max_tokens))


SAMPLING_DEFAULTS = (("presence_penalty", 0.0), ("frequency_penalty", 0.0), ("repetition_penalty", 1.0),
                     ("temperature", 1.0), ("top_p", 1.0), ("min_p", 0.0))  # fmt: skip
"""The sampling fields vLLM 0.32's render answer always holds for a chat request, with its defaults."""


def _number(body: dict[str, Any], name: str, default: float) -> float:
    value = body.get(name)
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else default


def generate_request(
    state: ServerState, body: dict[str, Any], request: web.Request, ids: list[int], max_tokens: int
) -> dict[str, Any]:
    """What vLLM's render endpoint answers (its ``GenerateRequest``, as pydantic dumps it): the
    token ids and the sampling parameters that differ from their defaults; no ``prompt`` text."""
    sampling: dict[str, Any] = {name: _number(body, name, default) for name, default in SAMPLING_DEFAULTS}
    sampling |= {"stop": [], "stop_token_ids": []}
    if bool_field(body, "ignore_eos", False):
        sampling["ignore_eos"] = True
    sampling |= {"max_tokens": max_tokens, "output_kind": 2, "skip_clone": True, "bad_words": [],
                 "skip_reading_prefix_cache": False}  # fmt: skip
    return {
        "request_id": f"chatcmpl-{base_request_id(request) or uuid.uuid4().hex[:16]}",
        "token_ids": ids,
        "token_offsets": None,
        "features": None,
        "content_parts": None,
        "sampling_params": sampling,
        "model": body.get("model"),
        "reasoning_ended": None,
        "reasoning_parser_kwargs": None,
        "return_token_ids": None,
        "output_mode": "tokens",
        "stream": False,
        "stream_options": None,
        "cache_salt": None,
        "priority": 0,
        "kv_transfer_params": None,
        "ec_transfer_params": None,
    }


async def tokenize(request: web.Request) -> web.Response:
    state: ServerState = request.app[STATE_KEY]
    body = await json_body(request)
    check_model(state, body)
    if "messages" in body:
        body.setdefault("add_generation_prompt", True)
        _, ids = render_chat(state, body)
    else:
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            raise HTTPError(400, "tokenize needs a string prompt or messages", param="prompt")
        ids = tokenize_text(state, prompt, bool_field(body, "add_special_tokens", True))
    strs = None
    if bool_field(body, "return_token_strs", False):
        strs = state.loaded.tokenizer.convert_ids_to_tokens(ids)
    return web.json_response(
        {"count": len(ids), "max_model_len": state.max_model_len, "tokens": ids, "token_strs": strs}
    )


async def detokenize(request: web.Request) -> web.Response:
    state: ServerState = request.app[STATE_KEY]
    body = await json_body(request)
    check_model(state, body)
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
    body = await json_body(request)
    text = body.get("plan") or ""
    try:
        state.faults = FaultPlan.parse(text) if text else None
    except ValueError as e:
        raise HTTPError(400, str(e)) from None
    return await get_faults(request)


async def put_capacity(request: web.Request) -> web.Response:
    state: ServerState = request.app[STATE_KEY]
    body = await json_body(request)
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
