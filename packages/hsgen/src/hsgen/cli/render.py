"""``hsgen render``: conversations to token ids + loss masks, with a local tokenizer or a server
(see ``docs/generate.md``)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import sys

import click

from hsgen.cli.render_options import (
    dataset_inputs,
    dataset_options,
    make_renderer,
    render_options,
    setup_logging,
    template_kwargs_option,
)

log = logging.getLogger("hsgen.generate.pipeline")


@click.command("render")
@click.argument("inputs", nargs=-1, required=True)
@dataset_options
@render_options
@click.option(
    "-o",
    "--output",
    type=click.Path(dir_okay=False, allow_dash=True),
    default="-",
    show_default=True,
    help="Where to write the JSONL records ('-' = stdout).",
)
@click.option(
    "--endpoint",
    "--server",
    "server",
    help="Render with this server instead of --tokenizer: vLLM's /v1/chat/completions/render (its own "
    "chat template) and /tokenize, e.g. http://localhost:8000. --chat-template does not apply.",
)
@click.option(
    "--model", help="With --server: the model id (default: the server's first GET /v1/models entry)."
)
@click.option(
    "--api-key", envvar="VLLM_API_KEY", help="With --server: bearer token (default: $VLLM_API_KEY)."
)
@click.option(
    "--concurrency", type=click.IntRange(min=1), default=16, show_default=True,
    help="With --server: render requests in flight.",
)  # fmt: skip
def render(
    inputs, split, max_samples, streaming, tokenizer, revision, chat_template, template_kwargs, max_len, on_too_long,
    on_bad_input, log_level, output, server, model, api_key, concurrency,
):  # fmt: skip
    """Render conversations to token ids + loss masks, one JSON object per line.

    INPUTS are JSONL, JSON or Parquet files, '-' for JSONL on stdin, a datasets directory or a
    Hugging Face dataset id (--split, --max-samples, --streaming), holding OpenAI
    'messages', ShareGPT 'conversations', pre-tokenized 'input_ids' (+ 'loss_mask') or plain
    'prompt' records. Each output line is {"id", "input_ids", "loss_mask"}, which
    'hsgen generate -' reads back: hsgen render data.jsonl --tokenizer DIR | hsgen generate - ...
    With --server the server renders instead of a local tokenizer. A summary line goes to stderr.
    """
    from hsgen.inputs.formats import InputError
    from hsgen.inputs.render import RenderError, Skipped, render_stream

    setup_logging(log_level)
    inputs = dataset_inputs(inputs, split, max_samples, streaming)
    if server:
        from hsgen.protocol.extraction import check_no_credentials

        try:
            check_no_credentials(server, "--server")
        except ValueError as e:
            raise click.UsageError(str(e)) from None
    if server and (tokenizer or chat_template):
        raise click.UsageError(
            "--server renders with the server's tokenizer and template: drop --tokenizer/--chat-template"
        )
    counts = {
        "rendered": 0,
        "tokens": 0,
        "truncated": 0,
        "too_long": 0,
        "bad_input": 0,
        "no_assistant_turn": 0,
    }
    try:
        out = sys.stdout if output == "-" else open(output, "w", encoding="utf-8")  # noqa: SIM115
    except OSError as e:
        raise click.ClickException(f"cannot write {output}: {e.strerror or e}") from None

    def emit(item) -> None:
        if isinstance(item, Skipped):
            counts[item.reason] += 1
            return
        out.write(json.dumps(item.to_json(), separators=(",", ":")) + "\n")
        counts["rendered"] += 1
        counts["tokens"] += len(item.token_ids)
        counts["truncated"] += int(item.truncated)
        if 1 not in item.loss_mask:
            counts["no_assistant_turn"] += 1
            if counts["no_assistant_turn"] <= 5:
                log.warning(
                    "%s: sample %r has no assistant turn: its loss mask is all 0", item.source, item.sample_id
                )

    fingerprint = ""
    try:
        if server:
            counts["server"] = server  # no local tokenizer, so no fingerprint
            kwargs = template_kwargs_option(template_kwargs)
            asyncio.run(_render_with_server(list(inputs), server, model, api_key, kwargs, max_len, on_too_long,
                                            on_bad_input, concurrency, emit))  # fmt: skip
        else:
            renderer = make_renderer(
                tokenizer, chat_template, template_kwargs, max_len, on_too_long, revision
            )
            fingerprint = renderer.fingerprint
            for item in render_stream(list(inputs), renderer, on_bad_input=on_bad_input):
                emit(item)
        if out is not sys.stdout:
            out.close()
        else:
            out.flush()
    except (InputError, RenderError) as e:
        raise click.ClickException(str(e)) from None
    except BrokenPipeError:
        sys.stderr.close()
        return
    except OSError as e:
        raise click.ClickException(f"cannot write {output}: {e.strerror or e}") from None
    finally:
        if out is not sys.stdout and not out.closed:
            with contextlib.suppress(OSError):
                out.close()
    if not any(counts[k] for k in ("rendered", "too_long", "bad_input")):
        log.warning("the input holds no records: nothing rendered")
    click.echo(json.dumps({**counts, "tokenizer_fingerprint": fingerprint}), err=True)


async def _render_with_server(
    inputs, server, model, api_key, template_kwargs, max_len, on_too_long, on_bad_input, concurrency, emit
) -> None:
    """Render every record through ``server`` and ``emit`` each result, in input order."""
    import aiohttp

    from hsgen.inputs.render_server import ServerRenderer, render_stream_with_server
    from hsgen.protocol.extraction import ProtocolError, auth_headers, models_url, served_model_ids

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        base = server.rstrip("/").removesuffix("/v1")
        if model is None:
            try:
                async with session.get(models_url(base), headers=auth_headers(api_key)) as r:
                    model = served_model_ids(await r.read())[0]
            except (aiohttp.ClientError, ProtocolError) as e:
                raise click.ClickException(f"{models_url(base)}: no model id ({e}); pass --model") from None
        renderer = ServerRenderer(base, model, api_key=api_key, template_kwargs=template_kwargs, max_len=max_len,
                                  on_too_long=on_too_long)  # fmt: skip
        try:
            async for item in render_stream_with_server(inputs, renderer, session, on_bad_input=on_bad_input,
                                                        concurrency=concurrency):  # fmt: skip
                emit(item)
        except aiohttp.ClientError as e:
            raise click.ClickException(f"{base}: {e}") from None
