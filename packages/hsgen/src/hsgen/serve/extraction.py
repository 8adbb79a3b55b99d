"""One request's extraction: its prompts through the engine, each file's lock taken before the
forward ends, the files written when the imitated vLLM version writes them, and the response."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from hsgen.protocol.prompt_logprobs import prompt_logprobs_entries
from hsgen.serve.engine import EngineRequest, EngineResult
from hsgen.serve.parse import bool_field
from hsgen.serve.state import HTTPError, ServerState
from hsgen.serve.writer import HiddenStatesWriter, PendingWrite

log = logging.getLogger(__name__)


@dataclass
class Job:
    prompt_token_ids: list[int]
    path: str
    fault: str | None = None
    pending: PendingWrite | None = None
    result: EngineResult | None = None


async def run_jobs(
    request: web.Request,
    state: ServerState,
    jobs: list[Job],
    max_tokens: list[int],
    body: dict[str, Any],
    include: bool,
    prompt_logprobs: int | None = None,
) -> None:
    """Run the jobs through the engine, taking each file's lock before the forward ends."""
    ignore_eos = bool_field(body, "ignore_eos", False)
    assert state.engine is not None and state.writer is not None
    writer = state.writer
    try:
        for job in jobs:
            job.pending = writer.prepare(job.path)
        results = await asyncio.gather(
            *(
                state.engine.generate(
                    EngineRequest(job.prompt_token_ids, mt, ignore_eos, include, prompt_logprobs)
                )
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


def _write_job(writer: HiddenStatesWriter, job: Job) -> None:
    assert job.pending is not None and job.result is not None
    writer.write(job.pending, job.result.hidden_states, job.result.hidden_token_ids, job.fault)


async def respond(
    request: web.Request, state: ServerState, body: dict[str, Any], jobs: list[Job]
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


async def pre_fault(state: ServerState) -> str | None:
    fault = state.faults.draw() if state.faults is not None else None
    if fault == "http_500":
        log.warning("fault injection: HTTP 500")
        raise HTTPError(500, "fault injection: internal server error", "InternalServerError")
    if fault == "hang":
        log.warning("fault injection: hanging for %.0f s", state.faults.hang_s)
        await asyncio.sleep(state.faults.hang_s)
    return fault


def usage(jobs: list[Job]) -> dict[str, Any]:
    prompt = sum(len(j.prompt_token_ids) for j in jobs)
    completion = sum(len(j.result.output_token_ids) for j in jobs)
    return {
        "prompt_tokens": prompt,
        "total_tokens": prompt + completion,
        "completion_tokens": completion,
        "prompt_tokens_details": None,
        "completion_tokens_details": None,
    }


def decode(state: ServerState, ids: list[int]) -> str:
    return state.loaded.tokenizer.decode(ids, skip_special_tokens=True)


MAX_LOGPROBS = 20
"""vLLM's default ``--max-logprobs``: the most ``prompt_logprobs`` a request may ask for (-1: all)."""


def prompt_logprobs_field(body: dict[str, Any]) -> int | None:
    """``prompt_logprobs`` of a request, checked as vLLM checks it (HTTP 400 otherwise)."""
    value = body.get("prompt_logprobs")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise HTTPError(400, "`prompt_logprobs` must be an integer.", param="prompt_logprobs")
    if body.get("stream") and (value > 0 or value == -1):
        raise HTTPError(
            400, "`prompt_logprobs` are not available when `stream=True`.", param="prompt_logprobs"
        )
    if value < -1:
        raise HTTPError(400, "`prompt_logprobs` must be a positive value or -1.", param="prompt_logprobs")
    if value > MAX_LOGPROBS:
        raise HTTPError(
            400,
            f"Requested prompt logprobs of {value}, which is greater than max allowed: {MAX_LOGPROBS}",
            param="prompt_logprobs",
        )
    return value


def prompt_logprobs_json(state: ServerState, job: Job) -> list | None:
    """``choices[i].prompt_logprobs`` of a finished job, as vLLM writes it."""
    plp = job.result.prompt_logprobs if job.result is not None else None
    if plp is None:
        return None
    tokenizer = state.loaded.tokenizer
    return prompt_logprobs_entries(
        job.prompt_token_ids,
        plp.top_ids.tolist(),
        plp.top_logprobs.tolist(),
        plp.token_logprobs.tolist(),
        plp.token_ranks.tolist(),
        lambda t: tokenizer.convert_ids_to_tokens(t),
    )
