"""Render prompts with a vLLM server instead of a local tokenizer.

Conversations go through ``POST /v1/chat/completions/render`` (the chat template vLLM itself
applies), plain prompts through ``POST /tokenize``. For when the verifier's tokenizer is only on
the server's machine; ``hsgen render --server`` uses it.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Mapping, Sequence
from typing import Any

from hsgen.inputs.formats import InputSample
from hsgen.inputs.render import (
    RenderedPrompt,
    RenderError,
    check_on_bad_input,
    limit_length,
    parse_input,
    skipped_record,
)


class RenderEndpointUnavailable(RenderError):
    """The server refuses every render request (its render endpoint is off or missing): no record
    can be rendered, so this ends the run whatever ``on_bad_input`` says."""


def _refusal(url: str, status: int, data: Any) -> RenderError:
    if status == 403:
        return RenderEndpointUnavailable(
            f"{url} answered 403: the server's render endpoint is disabled; start it with --enable-scale-out "
            "(vllm serve and hsgen serve both take it), or render locally with --tokenizer"
        )
    if status in (404, 405) and isinstance(data, Mapping) and "detail" in data:  # no such route
        return RenderEndpointUnavailable(
            f"{url} answered {status}: the server has no chat render endpoint; render locally with --tokenizer"
        )
    return RenderError(f"{url} answered {status}: {data}")


async def render_stream_with_server(
    paths: Sequence[str],
    renderer: ServerRenderer,
    session,
    *,
    on_bad_input: str = "fail",
    concurrency: int = 16,
):
    """:func:`render_stream` through a server: ``concurrency`` requests in flight, results in input order."""
    from hsgen.inputs.formats import InputError, iter_records

    check_on_bad_input(on_bad_input)

    async def one(rec, source):
        sample = None
        try:
            sample = parse_input(rec, source)
            return await renderer.render(session, sample)
        except RenderEndpointUnavailable:
            raise
        except (InputError, RenderError) as e:
            return skipped_record(e, sample and sample.sample_id, source, on_bad_input)

    pending: collections.deque[asyncio.Task] = collections.deque()
    try:
        for path in paths:
            for source, rec in iter_records(path):
                pending.append(asyncio.create_task(one(rec, source)))
                while len(pending) >= concurrency:
                    yield await pending.popleft()
        while pending:
            yield await pending.popleft()
    finally:
        for t in pending:
            t.cancel()


async def render_messages_with_server(
    session,
    base_url: str,
    model: str,
    messages: Sequence[Mapping[str, Any]],
    *,
    api_key: str | None = None,
    template_kwargs: Mapping[str, Any] | None = None,
    tools: Sequence[Mapping[str, Any]] | None = None,
) -> tuple[list[int], list[int]]:
    """Render a conversation with a server's ``POST /v1/chat/completions/render``.

    The mask comes from rendering each prefix: the ids of ``messages[:i]`` plus the generation
    prompt must be a prefix of the ids of ``messages[:i+1]``, which must be a prefix of the whole.
    As in local rendering, the turn's trailing whitespace tokens (found with ``POST /detokenize``)
    are not trained.

    Args:
        session: an ``aiohttp.ClientSession``.
        base_url: the server, e.g. ``http://localhost:8000``.
    """
    from hsgen.protocol.extraction import auth_headers

    url = base_url.rstrip("/") + "/v1/chat/completions/render"

    async def ids_of(msgs, add_generation_prompt: bool) -> list[int]:
        body = {
            "model": model,
            "messages": [dict(m) for m in msgs],
            "add_generation_prompt": add_generation_prompt,
            **({"chat_template_kwargs": dict(template_kwargs)} if template_kwargs else {}),
            **({"tools": [dict(t) for t in tools]} if tools else {}),
        }
        async with session.post(url, json=body, headers=auth_headers(api_key)) as r:
            data = await r.json(content_type=None)
            if r.status != 200:
                raise _refusal(url, r.status, data)
        ids = data.get("token_ids") if isinstance(data, Mapping) else None
        if ids is None and isinstance(data, Mapping):
            ids = data.get("prompt_token_ids")
        if not isinstance(ids, list):
            raise RenderError(f"{url} returned no token_ids")
        return [int(t) for t in ids]

    async def is_blank(token: int) -> bool:
        body = {"model": model, "tokens": [token]}
        async with session.post(detokenize_url, json=body, headers=auth_headers(api_key)) as r:
            data = await r.json(content_type=None)
            if r.status != 200:
                raise _refusal(detokenize_url, r.status, data)
        text = data.get("prompt") if isinstance(data, Mapping) else None
        if not isinstance(text, str):
            raise RenderError(f"{detokenize_url} returned no prompt")
        return not text.strip()

    detokenize_url = base_url.rstrip("/") + "/detokenize"
    full = await ids_of(messages, False)
    mask = [0] * len(full)
    for i, m in enumerate(messages):
        if m.get("role") != "assistant":
            continue
        pre = await ids_of(messages[:i], True) if i else []
        upto = await ids_of(messages[: i + 1], False)
        if upto[: len(pre)] != pre or full[: len(upto)] != upto:
            raise RenderError(
                f"the server's chat template does not render assistant turn {i} as a prefix: use local rendering"
            )
        end = len(upto)
        while end > len(pre) + 1 and await is_blank(upto[end - 1]):
            end -= 1  # the template's whitespace after the turn (``<|im_end|>\\n``) is not generated
        for t in range(len(pre), end):
            mask[t] = 1
    return full, mask


class ServerRenderer:
    """Renders samples with a server instead of a local tokenizer: conversations with
    ``POST /v1/chat/completions/render`` (the chat template vLLM itself applies), plain prompts
    with ``POST /tokenize``. For when the verifier's tokenizer is only on the server's machine.

    Args:
        base_url: the server, e.g. ``http://localhost:8000`` (a trailing ``/v1`` is accepted).
        model: the model id to name in requests.
        api_key, template_kwargs, max_len, on_too_long: as for :class:`ChatRenderer`.
    """

    def __init__(
        self,
        base_url: str,
        model: str,
        *,
        api_key: str | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
        max_len: int | None = None,
        on_too_long: str = "truncate",
    ):
        base = base_url.rstrip("/")
        self.base_url = base[: -len("/v1")] if base.endswith("/v1") else base
        self.model = model
        self.api_key = api_key
        self.template_kwargs = dict(template_kwargs or {})
        self.max_len = max_len
        self.on_too_long = on_too_long

    async def render(self, session, sample: InputSample) -> RenderedPrompt:
        """Like :meth:`ChatRenderer.render`, through the server (``session``: an ``aiohttp.ClientSession``)."""
        try:
            if sample.kind == "tokens":
                ids = list(sample.input_ids or ())
                mask = list(sample.loss_mask) if sample.loss_mask is not None else [1] * len(ids)
            elif sample.kind == "prompt":
                ids = await self._tokenize(session, sample.prompt or "")
                mask = [1] * len(ids)
            else:
                ids, mask = await render_messages_with_server(
                    session, self.base_url, self.model, sample.messages or (), api_key=self.api_key,
                    template_kwargs=self.template_kwargs, tools=sample.tools,
                )  # fmt: skip
        except RenderEndpointUnavailable:
            raise
        except RenderError as e:
            raise RenderError(f"{sample.source}: {e}") from None
        if not ids:
            raise RenderError(f"{sample.source}: renders to no tokens")
        return limit_length(RenderedPrompt(sample.sample_id, ids, mask, source=sample.source), self.max_len,
                            self.on_too_long)  # fmt: skip

    async def _tokenize(self, session, text: str) -> list[int]:
        from hsgen.protocol.extraction import auth_headers

        url = self.base_url + "/tokenize"
        body = {"model": self.model, "prompt": text, "add_special_tokens": True}
        async with session.post(url, json=body, headers=auth_headers(self.api_key)) as r:
            data = await r.json(content_type=None)
            if r.status != 200:
                raise RenderError(f"{url} answered {r.status}: {data}")
        tokens = data.get("tokens") if isinstance(data, Mapping) else None
        if not isinstance(tokens, list):
            raise RenderError(f"{url} returned no tokens")
        return [int(t) for t in tokens]


__all__ = [
    "RenderEndpointUnavailable",
    "ServerRenderer",
    "render_messages_with_server",
    "render_stream_with_server",
]
