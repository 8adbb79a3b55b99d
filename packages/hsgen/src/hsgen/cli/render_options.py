"""Options and set-up shared by ``hsgen render`` and ``hsgen generate``: the rendering options,
the dataset-input options, and what they build (the renderer, the inputs, logging)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import click


def apply_options(f: Callable, options: Sequence[Callable]) -> Callable:
    """``f`` decorated with ``options`` so that ``--help`` lists them in the order given."""
    for opt in reversed(options):
        f = opt(f)
    return f


def setup_logging(level: str) -> None:
    """Log lines on stderr, credentials in URLs redacted (:mod:`hsgen.log_format`)."""
    from hsgen.log_format import setup_logging as setup

    setup(level if level.upper() in logging.getLevelNamesMapping() else "INFO")


def template_kwargs_option(text: str | None) -> dict[str, Any]:
    from hsgen.cli.toolkit import json_object_option

    return json_object_option(text, "--template-kwargs")


def render_options(f):
    """Options shared by ``render`` and ``generate``."""
    opts = [
        click.option(
            "--tokenizer",
            help="The verifier's tokenizer: a local directory with tokenizer.json and tokenizer_config.json, "
            "or a Hugging Face model id (e.g. Qwen/Qwen3-8B; only its tokenizer files are fetched, cache "
            "first). Needed for 'messages', 'conversations' and 'prompt' records; pre-tokenized "
            "'input_ids' records do not need it.",
        ),
        click.option(
            "--revision",
            help="Branch, tag or commit of a hub --tokenizer [default: main].",
        ),
        click.option(
            "--chat-template",
            type=click.Path(exists=True, dir_okay=False),
            help="Jinja chat template file overriding the tokenizer's own.",
        ),
        click.option(
            "--template-kwargs",
            help="Extra chat-template variables as a JSON object, e.g. '{\"enable_thinking\": false}'.",
        ),
        click.option(
            "--max-len",
            type=click.IntRange(min=1),
            help="Longest prompt in tokens (vLLM needs max_model_len - 1). Default: no limit.",
        ),
        click.option(
            "--on-too-long",
            type=click.Choice(["truncate", "skip"]),
            default="truncate",
            show_default=True,
            help="What to do with a prompt over --max-len: keep its first --max-len tokens, or skip it.",
        ),
        click.option(
            "--on-bad-input",
            type=click.Choice(["skip", "fail"]),
            default="fail",
            show_default=True,
            help="A record that cannot be read or rendered: stop with an error naming file and line, "
            "or skip it (skips are counted, and listed in the failures file).",
        ),
        click.option(
            "--log-level",
            type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"], case_sensitive=False),
            default="INFO",
            show_default=True,
            help="Logging level (logs go to stderr).",
        ),
    ]
    return apply_options(f, opts)


def dataset_options(f):
    """``--split``, ``--max-samples`` and ``--streaming`` for inputs that are datasets."""
    opts = [
        click.option(
            "--split",
            default="train",
            show_default=True,
            help="Split read from a dataset input (a hub dataset id or a datasets directory).",
        ),
        click.option(
            "--max-samples",
            type=click.IntRange(min=1),
            help="Rows read from each dataset input [default: all].",
        ),
        click.option(
            "--streaming",
            is_flag=True,
            help="Stream a hub dataset's rows as they are consumed instead of downloading its files first.",
        ),
    ]
    return apply_options(f, opts)


def dataset_inputs(inputs, split, max_samples, streaming) -> list:
    from hsgen.inputs.hf_datasets import as_input

    return [as_input(x, split=split, max_samples=max_samples, streaming=streaming) for x in inputs]


def make_renderer(tokenizer, chat_template, template_kwargs, max_len, on_too_long, revision=None):
    from hsgen.hf.hub import HubError, resolve
    from hsgen.inputs.render import ChatRenderer, RenderConfig, RenderError

    try:
        tokenizer = resolve(tokenizer, revision=revision) if tokenizer else None
    except HubError as e:
        raise click.BadParameter(str(e), param_hint="--tokenizer") from None
    try:
        return ChatRenderer(
            RenderConfig(
                tokenizer_path=str(tokenizer) if tokenizer else None,
                chat_template=chat_template,
                max_len=max_len,
                on_too_long=on_too_long,
                template_kwargs=template_kwargs_option(template_kwargs),
            )
        )
    except RenderError as e:
        raise click.ClickException(str(e)) from None
