"""The route handlers: vLLM's OpenAI-compatible endpoints, the small ones (health, version,
metrics, models) and the test-only ``/hsgen/*`` admin endpoints."""

from __future__ import annotations

import os
import time
import uuid
from typing import Any

from aiohttp import web

from hsgen import protocol
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
    check_model,
    common_checks,
    completion_prompts,
    int_field,
    json_body,
    kv_params,
    render_chat,
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


# --------------------------------------------------------------------------- request parsing


async def completions(request: web.Request) -> web.StreamResponse:
    state: ServerState = request.app[STATE_KEY]
    body = await json_body(request)
    check_model(state, body)
    common_checks(body)
    prompts = completion_prompts(state, body)
    requested = int_field(body, "max_tokens", 16, 1)
    max_tokens = [validate_prompt(state, p, requested) for p in prompts]
    include, custom = kv_params(state, body)
    return_ids = bool_field(body, "return_token_ids", False)
    want_logprobs = prompt_logprobs_field(body)
    request_id = protocol.completion_request_id(base_request_id(request))
    state.requests_total += 1
    fault = await pre_fault(state)
    jobs = []
    for i, p in enumerate(prompts):
        name = protocol.hidden_states_filename(request_id, i)
        path = custom if (custom and i == 0) else os.path.join(state.config.shared_storage_path, name)
        jobs.append(Job(p, path, fault if i == 0 else None))
    await run_jobs(request, state, jobs, max_tokens, body, include, want_logprobs)
    choices = []
    for i, job in enumerate(jobs):
        choice: dict[str, Any] = {
            "index": i,
            "text": decode(state, job.result.output_token_ids),
            "logprobs": None,
            "finish_reason": job.result.finish_reason,
            "stop_reason": None,
            "prompt_logprobs": prompt_logprobs_json(state, job),
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
        "usage": usage(jobs),
        "kv_transfer_params": {"hidden_states_path": jobs[0].path},
    }
    return await respond(request, state, out, jobs)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    state: ServerState = request.app[STATE_KEY]
    body = await json_body(request)
    check_model(state, body)
    common_checks(body)
    _, ids = render_chat(state, body)
    requested = int_field(body, "max_completion_tokens", None, 1)
    if requested is None:
        requested = int_field(body, "max_tokens", None, 1)
    max_tokens = validate_prompt(state, ids, requested)
    include, custom = kv_params(state, body)
    return_ids = bool_field(body, "return_token_ids", False)
    base = base_request_id(request) or uuid.uuid4().hex[:16]
    request_id = f"chatcmpl-{base}"
    state.requests_total += 1
    fault = await pre_fault(state)
    path = custom or os.path.join(
        state.config.shared_storage_path, f"{request_id}-{uuid.uuid4().hex[:8]}.safetensors"
    )
    jobs = [Job(ids, path, fault)]
    await run_jobs(request, state, jobs, [max_tokens], body, include)
    res = jobs[0].result
    choice: dict[str, Any] = {
        "index": 0,
        "message": {"role": "assistant", "content": decode(state, res.output_token_ids), "tool_calls": []},
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
        "usage": usage(jobs),
        "prompt_logprobs": None,
        "prompt_token_ids": ids if return_ids else None,
        "kv_transfer_params": {"hidden_states_path": path},
    }
    return await respond(request, state, out, jobs)


async def chat_render(request: web.Request) -> web.Response:
    state: ServerState = request.app[STATE_KEY]
    body = await json_body(request)
    check_model(state, body)
    text, ids = render_chat(state, body)
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
