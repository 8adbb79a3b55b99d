"""The aiohttp application: vLLM's OpenAI-compatible endpoints with hidden-state extraction.

Field names, status codes and error bodies follow vLLM (see ``docs/serve.md``). Only paths
starting with ``/v1`` need the API key, exactly as vLLM's ``AuthenticationMiddleware``. ``/hsgen/*`` (faults, capacity) exists only with
``ServeConfig.enable_admin``.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import secrets

from aiohttp import web

from hsgen.serve.engine import Engine
from hsgen.serve.handlers import (
    chat_completions,
    chat_render,
    completions,
    detokenize,
    get_faults,
    health,
    metrics,
    models,
    put_capacity,
    put_faults,
    tokenize,
    version,
)
from hsgen.serve.state import STATE_KEY, HTTPError, ServerState, build_state
from hsgen.serve.writer import HiddenStatesWriter

__all__ = ["STATE_KEY", "HTTPError", "ServerState", "build_state", "create_app"]

log = logging.getLogger(__name__)

NO_ROUTE = {404: "Not Found", 405: "Method Not Allowed"}


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
        if e.status in NO_ROUTE:  # FastAPI's own body, as vLLM answers
            return web.json_response({"detail": NO_ROUTE[e.status]}, status=e.status)
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
