"""``hsgen generate`` (see ``docs/generate.md``); its options are in :mod:`hsgen.cli.generate_options`,
``hsgen render`` in :mod:`hsgen.cli.render`."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
from functools import partial
from pathlib import Path

import click

from hsgen.cli.generate_options import generate_options
from hsgen.cli.render import render
from hsgen.cli.render_options import dataset_inputs, make_renderer, setup_logging
from hsgen.inputs.count import count_records

__all__ = ["generate", "render"]

log = logging.getLogger("hsgen.generate.pipeline")


@click.command("generate")
@click.argument("inputs", nargs=-1, required=True)
@generate_options
def generate(
    inputs,
    split,
    max_samples,
    streaming,
    store_path,
    endpoints,
    endpoint_per_local_rank,
    shared_dir,
    api_key,
    model,
    layer_ids,
    verifier,
    dtype,
    codec,
    targets,
    tokenizer,
    revision,
    chat_template,
    template_kwargs,
    max_len,
    on_too_long,
    on_bad_input,
    log_level,
    concurrency,
    max_concurrency,
    world_size,
    rank,
    join,
    join_chunk,
    failures_path,
    limit,
    shard_mb,
    commit_interval,
    max_buffer_mb,
    timeout,
    file_wait,
    lock_timeout,
    retries,
    breaker_threshold,
    breaker_cooldown,
    max_down,
    stop_grace,
    max_consecutive_failures,
    include_output_tokens,
    check_finite,
    keep_server_files,
    writer_id,
    progress,
):
    """Fetch hidden states for the prompts in INPUTS from vLLM servers into a store.

    INPUTS are dataset files (JSONL, JSON, Parquet), '-' for JSONL on stdin (e.g. the output
    of 'hsgen render'), a datasets directory or a Hugging Face dataset id (--split, --max-samples). Re-running resumes: samples already in the store are skipped.
    Prints one JSON summary line on stdout. Exit codes: 0 all stored, 3 partial (some prompts
    failed; see the failures file), 1 failure (nothing stored, or a fatal error), 130 interrupted.
    """
    from hsgen.client.config import ClientConfig
    from hsgen.client.saturate import SaturationConfig
    from hsgen.generate.launcher import endpoints_for_rank, resolve_ranks
    from hsgen.generate.pipeline import GenerateConfig
    from hsgen.generate.pipeline import generate as run_generate
    from hsgen.inputs.render import render_stream
    from hsgen.protocol import extraction as protocol
    from hsgen.store.backend import is_remote

    setup_logging(log_level)
    inputs = dataset_inputs(inputs, split, max_samples, streaming)
    try:
        ranks = resolve_ranks(world_size, rank)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--rank") from None
    original = list(endpoints)
    try:
        endpoints = endpoints_for_rank(endpoints, ranks, per_local_rank=endpoint_per_local_rank)
    except ValueError as e:  # a bad template, or credentials in a URL (the message shows it redacted)
        raise click.UsageError(str(e)) from None
    world_size, rank = ranks.world_size, ranks.rank
    if join and is_remote(store_path):
        raise click.BadParameter(
            "claims need a store on a file system, not object storage", param_hint="--join"
        )
    if ranks.world_size > 1 or ranks.source != "default" or any("{" in e for e in original):
        shown = ", ".join(protocol.redact_url(e) for e in endpoints)
        log.info("hsgen generate: %s, endpoints %s", ranks.describe(), shown)
    ids = None
    if layer_ids:
        try:
            ids = protocol.parse_layer_ids(layer_ids)
        except ValueError as e:
            raise click.BadParameter(str(e), param_hint="--layer-ids") from None
    renderer = make_renderer(tokenizer, chat_template, template_kwargs, max_len, on_too_long, revision)
    from hsgen.store import StoreError
    from hsgen.store.opening import check_matches, open_existing

    try:
        store = open_existing(store_path)
        if store is not None:
            check_matches(store, layer_ids=ids, dtype=dtype, fingerprint=renderer.fingerprint)
    except StoreError as e:
        raise click.ClickException(str(e)) from None
    if store is None and ids is None:
        raise click.UsageError(f"{store_path} is not a store yet: --layer-ids is needed to create it")
    shape = None
    if store is None:  # a new store's shape: layers, the model's hidden size, the dtype asked for
        from hsgen.generate.store_shape import StoreShape

        try:
            shape = StoreShape.named(ids, verifier=verifier, tokenizer_dir=renderer.config.tokenizer_path,
                                     dtype=dtype, revision=revision)  # fmt: skip
        except ValueError as e:
            raise click.UsageError(str(e)) from None
    if store is not None:
        try:
            check_matches(store, targets=targets)
        except StoreError as e:
            raise click.BadParameter(str(e), param_hint="--targets") from None
    targets = store.header.targets if store is not None else (targets or "states")
    try:
        client_cfg = ClientConfig(
            endpoints=list(endpoints),
            shared_dir=shared_dir,
            api_key=api_key or None,
            model=model,
            include_output_tokens=include_output_tokens,
            targets=targets,
            request_timeout_s=timeout,
            file_wait_s=file_wait,
            lock_timeout_s=lock_timeout,
            max_retries=retries,
            breaker_threshold=breaker_threshold,
            breaker_cooldown_s=breaker_cooldown,
            max_down_s=max_down,
            check_finite=check_finite,
            delete_files=not keep_server_files,
        )
        cfg = GenerateConfig(
            client=client_cfg,
            saturation=SaturationConfig(
                concurrency=concurrency, max_limit=max_concurrency, initial=min(8, max_concurrency)
            ),
            world_size=world_size,
            rank=rank,
            writer_id=writer_id,
            shard_bytes=int(shard_mb * (1 << 20)),
            commit_interval_s=commit_interval,
            max_buffer_bytes=int(max_buffer_mb * (1 << 20)),
            failures_path=failures_path or _failures_default(store_path, rank, world_size),
            max_samples=limit,
            max_consecutive_failures=max_consecutive_failures,
            stop_grace_s=stop_grace,
            on_bad_input=on_bad_input,
            join=join,
            join_chunk=join_chunk,
        )
    except ValueError as e:
        raise click.UsageError(str(e)) from None
    if renderer.config.tokenizer_path:  # checked against each server before any work is sent
        from hsgen.client.tokenizer_check import PROBE, TokenizerMismatch, check_served_tokenizer

        try:
            check_served_tokenizer(endpoints, renderer.encode(PROBE)[0], flag="--tokenizer",
                                   api_key=api_key or None, model=model)  # fmt: skip
        except TokenizerMismatch as e:
            raise click.ClickException(str(e)) from None
    if store is None:
        from hsgen.generate.store_shape import NewStore

        store = NewStore(store_path, shape, verifier=verifier or model, fingerprint=renderer.fingerprint,
                         codec=codec, targets=targets)  # fmt: skip
    prompts = render_stream(list(inputs), renderer, on_bad_input=on_bad_input)
    if join and "-" not in inputs:  # a joined run may read the input again for dead writers' chunks
        prompts = lambda: render_stream(list(inputs), renderer, on_bad_input=on_bad_input)  # noqa: E731
    show = progress is not False  # a bar on a terminal, log lines otherwise: see hsgen.progress
    count = partial(count_records, inputs) if show else None  # the bar's total and ETA
    summary = asyncio.run(_run_with_signals(run_generate, cfg, prompts, store, show, count))
    summary.store = summary.store or str(store_path)
    click.echo(summary.to_json())  # a fatal error was logged once, on one line, by the run
    from hsgen.generate.report import failures_line

    line = failures_line(summary)
    if line:  # failed requests: one line on stderr, the detail in the failures file
        click.echo(f"hsgen generate: {line}", err=True)
    sys.exit(summary.exit_code)


def _failures_default(store_path, rank: int, world_size: int) -> str:
    """Beside a store on disk; in the working directory for one on object storage."""
    from hsgen.generate.pipeline import default_failures_path
    from hsgen.store.backend import is_remote

    if is_remote(store_path):
        return default_failures_path(Path(str(store_path).rstrip("/").rsplit("/", 1)[-1]), rank, world_size)
    return default_failures_path(store_path, rank, world_size)


async def _run_with_signals(run, cfg, prompts, store, show, count=None):
    """Run ``generate``; the first SIGINT/SIGTERM stops new requests, a second one cancels."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    main = asyncio.current_task()
    hits = {"n": 0}

    def on_signal(signame: str) -> None:
        hits["n"] += 1
        if hits["n"] == 1:
            log.warning("%s: finishing in-flight requests and committing (again to abort them)", signame)
            stop.set()
        elif main is not None:
            main.cancel()

    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError):  # non-Unix
            loop.add_signal_handler(sig, on_signal, sig.name)
    try:
        return await run(cfg, prompts, store, progress=show, stop=stop, count=count)
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.remove_signal_handler(sig)


os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
