"""``hsgen render`` and ``hsgen generate`` (see ``docs/generate.md``)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import sys
from pathlib import Path
from typing import Any

import click

log = logging.getLogger("hsgen.generate")


def _setup_logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )


def _template_kwargs(text: str | None) -> dict[str, Any]:
    from hsgen.cli import json_object_option

    return json_object_option(text, "--template-kwargs")


def _render_options(f):
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
    for opt in reversed(opts):
        f = opt(f)
    return f


def _dataset_options(f):
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
    for opt in reversed(opts):
        f = opt(f)
    return f


def _dataset_inputs(inputs, split, max_samples, streaming) -> list:
    from hsgen.hf_datasets import as_input

    return [as_input(x, split=split, max_samples=max_samples, streaming=streaming) for x in inputs]


def _make_renderer(tokenizer, chat_template, template_kwargs, max_len, on_too_long, revision=None):
    from hsgen.hub import HubError, resolve
    from hsgen.render import ChatRenderer, RenderConfig, RenderError

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
                template_kwargs=_template_kwargs(template_kwargs),
            )
        )
    except RenderError as e:
        raise click.ClickException(str(e)) from None


@click.command("render")
@click.argument("inputs", nargs=-1, required=True)
@_dataset_options
@_render_options
@click.option(
    "-o",
    "--output",
    type=click.Path(dir_okay=False, allow_dash=True),
    default="-",
    show_default=True,
    help="Where to write the JSONL records ('-' = stdout).",
)
@click.option(
    "--server",
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
    from hsgen.inputs import InputError
    from hsgen.render import RenderError, Skipped, render_stream

    _setup_logging(log_level)
    inputs = _dataset_inputs(inputs, split, max_samples, streaming)
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
            kwargs = _template_kwargs(template_kwargs)
            asyncio.run(_render_with_server(list(inputs), server, model, api_key, kwargs, max_len, on_too_long,
                                            on_bad_input, concurrency, emit))  # fmt: skip
        else:
            renderer = _make_renderer(
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

    from hsgen.protocol import auth_headers
    from hsgen.render_server import ServerRenderer, render_stream_with_server

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        base = server.rstrip("/").removesuffix("/v1")
        if model is None:
            try:
                async with session.get(base + "/v1/models", headers=auth_headers(api_key)) as r:
                    model = (await r.json(content_type=None))["data"][0]["id"]
            except (aiohttp.ClientError, KeyError, IndexError, TypeError, ValueError) as e:
                raise click.ClickException(f"{base}/v1/models: no model id ({e}); pass --model") from None
        renderer = ServerRenderer(base, model, api_key=api_key, template_kwargs=template_kwargs, max_len=max_len,
                                  on_too_long=on_too_long)  # fmt: skip
        try:
            async for item in render_stream_with_server(inputs, renderer, session, on_bad_input=on_bad_input,
                                                        concurrency=concurrency):  # fmt: skip
                emit(item)
        except aiohttp.ClientError as e:
            raise click.ClickException(f"{base}: {e}") from None


@click.command("generate")
@click.argument("inputs", nargs=-1, required=True)
@_dataset_options
@click.option(
    "--store",
    "store_path",
    required=True,
    type=click.Path(file_okay=False, path_type=Path),
    help="The store directory; created if missing, resumed (existing ids skipped) if present.",
)
@click.option(
    "--endpoint",
    "endpoints",
    multiple=True,
    required=True,
    help="A server's base URL, e.g. http://localhost:8000 (a trailing /v1 is accepted). Repeat for "
    "several servers; each request goes to the least loaded one.",
)
@click.option(
    "--shared-dir",
    default="/tmp",
    show_default=True,
    help="The servers' shared_storage_path as seen from this machine. Files named outside it are refused.",
)
@click.option(
    "--api-key",
    envvar="VLLM_API_KEY",
    help="Bearer token for servers started with --api-key (default: $VLLM_API_KEY).",
)
@click.option("--model", help="Model id to request (default: each server's first GET /v1/models entry).")
@click.option(
    "--layer-ids",
    help="The layer ids the servers extract (their eagle_aux_hidden_state_layer_ids), e.g. '2,18,33,36'. "
    "Required to create a store; checked against an existing one.",
)
@click.option(
    "--verifier", help="Verifier name recorded in a new store's header (default: the served model id)."
)
@click.option(
    "--codec",
    type=click.Choice(["raw", "lz4", "fp8"]),
    default="raw",
    show_default=True,
    help="Encoding of a new store: raw, lz4 (lossless) or fp8 (lossy e4m3 with per-token scale).",
)
@_render_options
@click.option(
    "--concurrency",
    type=click.IntRange(min=1),
    help="Fixed requests in flight per server. Default: adaptive (keep each server's queue just non-empty).",
)
@click.option(
    "--max-concurrency",
    type=click.IntRange(min=1),
    default=4096,
    show_default=True,
    help="Upper bound of the adaptive concurrency per server.",
)
@click.option(
    "--world-size",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    envvar="HSGEN_WORLD_SIZE",
    help="Number of ranks (nodes/processes) filling one store; the input is split by a hash of the sample id.",
)
@click.option(
    "--rank",
    type=click.IntRange(min=0),
    default=0,
    show_default=True,
    envvar="HSGEN_RANK",
    help="This process's rank, 0..world_size-1.",
)
@click.option(
    "--failures",
    "failures_path",
    type=click.Path(dir_okay=False),
    help="JSONL file listing prompts that failed or were skipped, with the reason "
    "(default: <store>.failures.jsonl beside the store; .rank<R> added when --world-size > 1).",
)
@click.option(
    "--limit",
    type=click.IntRange(min=1),
    help="Request at most this many new samples (already stored ones are free).",
)
@click.option(
    "--shard-mb",
    type=click.FloatRange(min=0.001),
    default=32.0,
    show_default=True,
    help="Shard size to commit at.",
)
@click.option(
    "--commit-interval",
    type=click.FloatRange(min=0.1),
    default=60.0,
    show_default=True,
    help="Commit buffered samples at least this often (seconds), however few.",
)
@click.option(
    "--max-buffer-mb",
    type=click.FloatRange(min=1),
    default=1024.0,
    show_default=True,
    help="Memory bound: no new request starts while this much fetched data waits for the store.",
)
@click.option(
    "--timeout",
    type=click.FloatRange(min=0.1),
    default=600.0,
    show_default=True,
    help="Limit for one HTTP request, queueing on the server included (seconds).",
)
@click.option(
    "--file-wait",
    type=click.FloatRange(min=0.0),
    default=60.0,
    show_default=True,
    help="How long the file or its .lock may take to appear after the response (vLLM >= 0.24 writes late).",
)
@click.option(
    "--lock-timeout",
    type=click.FloatRange(min=0.0),
    default=300.0,
    show_default=True,
    help="How long a server may hold a file's .lock before the attempt fails.",
)
@click.option(
    "--retries",
    type=click.IntRange(min=0),
    default=3,
    show_default=True,
    help="Extra attempts per prompt after a transient failure (transport, timeout, 5xx, bad file).",
)
@click.option(
    "--breaker-threshold",
    type=click.IntRange(min=1),
    default=5,
    show_default=True,
    help="Consecutive failures after which a server gets no requests for --breaker-cooldown seconds.",
)
@click.option(
    "--breaker-cooldown",
    type=click.FloatRange(min=0.0),
    default=10.0,
    show_default=True,
    help="Seconds an open circuit breaker waits before probing the server again.",
)
@click.option(
    "--max-down",
    type=click.FloatRange(min=0.0),
    default=600.0,
    show_default=True,
    help="End the run (exit 1) when no server has answered for this many seconds (0 = never give up).",
)
@click.option(
    "--stop-grace",
    type=click.FloatRange(min=0.0),
    default=30.0,
    show_default=True,
    help="After Ctrl-C or SIGTERM, how long requests already sent may finish before they are cancelled.",
)
@click.option(
    "--max-consecutive-failures",
    type=click.IntRange(min=0),
    default=200,
    show_default=True,
    help="Abort when this many prompts fail in a row (0 = never).",
)
@click.option(
    "--include-output-tokens",
    is_flag=True,
    help="Send kv_transfer_params.include_output_tokens (vLLM >= 0.24); the extra rows are dropped.",
)
@click.option(
    "--check-finite/--no-check-finite",
    default=True,
    show_default=True,
    help="Refuse samples with NaN or infinite hidden states.",
)
@click.option(
    "--keep-server-files",
    is_flag=True,
    help="Do not delete the servers' files and locks after reading (debugging; they accumulate).",
)
@click.option("--writer-id", help="Store writer id (default: host-pid-random; reuse one to resume it).")
@click.option(
    "--progress/--no-progress",
    default=None,
    help="Show a progress bar on stderr (default: when stderr is a terminal).",
)
def generate(
    inputs,
    split,
    max_samples,
    streaming,
    store_path,
    endpoints,
    shared_dir,
    api_key,
    model,
    layer_ids,
    verifier,
    codec,
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
    from hsgen import protocol
    from hsgen.client import ClientConfig
    from hsgen.generate import GenerateConfig, default_failures_path
    from hsgen.generate import generate as run_generate
    from hsgen.render import render_stream
    from hsgen.saturate import SaturationConfig

    _setup_logging(log_level)
    inputs = _dataset_inputs(inputs, split, max_samples, streaming)
    if rank >= world_size:
        raise click.BadParameter(f"must be < --world-size ({world_size})", param_hint="--rank")
    ids = None
    if layer_ids:
        try:
            ids = protocol.parse_layer_ids(layer_ids)
        except ValueError as e:
            raise click.BadParameter(str(e), param_hint="--layer-ids") from None
    renderer = _make_renderer(tokenizer, chat_template, template_kwargs, max_len, on_too_long, revision)
    if ids is not None and renderer.config.tokenizer_path:  # a model directory (or a hub id's snapshot)
        _check_layer_ids(ids, Path(renderer.config.tokenizer_path))
    store = _open_store(store_path, ids, renderer.fingerprint)
    if store is None and ids is None:
        raise click.UsageError(f"{store_path} is not a store yet: --layer-ids is needed to create it")
    try:
        client_cfg = ClientConfig(
            endpoints=list(endpoints),
            shared_dir=shared_dir,
            api_key=api_key or None,
            model=model,
            include_output_tokens=include_output_tokens,
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
            failures_path=failures_path or default_failures_path(store_path, rank, world_size),
            max_samples=limit,
            max_consecutive_failures=max_consecutive_failures,
            stop_grace_s=stop_grace,
            on_bad_input=on_bad_input,
        )
    except ValueError as e:
        raise click.UsageError(str(e)) from None
    if store is None:
        store = _store_factory(store_path, ids, verifier or model, renderer.fingerprint, codec, cfg)
    prompts = render_stream(list(inputs), renderer, on_bad_input=on_bad_input)
    show = progress is not False  # a bar on a terminal, log lines otherwise: see hsgen.progress
    summary = asyncio.run(_run_with_signals(run_generate, cfg, prompts, store, show))
    summary.store = summary.store or str(store_path)
    click.echo(summary.to_json())  # a fatal error was logged once, on one line, by the run
    sys.exit(summary.exit_code)


def _check_layer_ids(layer_ids, model_dir: Path) -> None:
    """With the model's config.json at hand (``--tokenizer`` is often the model directory), every
    layer id must be one of its layers: 0 (embeddings) to ``num_hidden_layers``."""
    from hsgen import protocol

    try:
        config = json.loads((model_dir / "config.json").read_text())
        layers = int(config.get("text_config", config)["num_hidden_layers"])
    except (OSError, ValueError, KeyError, TypeError):
        return
    try:
        protocol.normalize_layer_ids(layer_ids, layers)
    except ValueError as e:
        raise click.BadParameter(f"{e} ({model_dir / 'config.json'})", param_hint="--layer-ids") from None


def _open_store(path: Path, layer_ids, fingerprint: str):
    from hsgen.store import HiddenStateStore, StoreError
    from hsgen.store.store import HEADER_FILE

    if not (path / HEADER_FILE).exists() and (not path.is_dir() or not _visible_entries(path)):
        return None  # not created yet (a first run may have left only its lease)
    try:
        store = HiddenStateStore.open(path)
    except StoreError as e:
        raise click.ClickException(str(e)) from None
    h = store.header
    if layer_ids is not None and tuple(layer_ids) != tuple(h.layer_ids):
        raise click.ClickException(
            f"{path} holds layer ids {list(h.layer_ids)}, --layer-ids says {list(layer_ids)}: use another store"
        )
    if fingerprint and h.tokenizer_fingerprint and fingerprint != h.tokenizer_fingerprint:
        raise click.ClickException(
            f"{path} was rendered with another tokenizer or chat template "
            f"(fingerprint {h.tokenizer_fingerprint[:12]}..., now {fingerprint[:12]}...): use another store"
        )
    return store


def _visible_entries(path: Path) -> list[str]:
    return [e for e in os.listdir(path) if not e.startswith(".")]


def _store_factory(path: Path, layer_ids, verifier, fingerprint: str, codec: str, cfg):
    """The store at ``path``, created from the first sample's shape (hidden size, dtype)."""
    from hsgen.store_sink import LazyStore

    def create(sample):
        from hsgen.store import HiddenStateStore, StoreHeader

        n_layers, hidden = sample.hidden_states.shape[1:]
        if n_layers != len(layer_ids):
            raise ValueError(
                f"the server sends {n_layers} layers but --layer-ids names {len(layer_ids)} ({list(layer_ids)})"
            )
        name = verifier or _served_model(sample.endpoint, cfg) or sample.endpoint
        header = StoreHeader(
            verifier=name,
            layer_ids=tuple(layer_ids),
            hidden_size=int(hidden),
            dtype=sample.dtype,
            tokenizer_fingerprint=fingerprint,
            codec=codec,
        )
        return HiddenStateStore.create(path, header)

    return LazyStore(path, create)


def _served_model(url: str, cfg) -> str | None:
    import urllib.request

    from hsgen import protocol

    try:
        req = urllib.request.Request(url + "/v1/models", headers=protocol.auth_headers(cfg.client.api_key))
        with urllib.request.urlopen(req, timeout=10) as r:
            return str(json.loads(r.read())["data"][0]["id"])
    except Exception:  # the header then names the endpoint instead
        return None


async def _run_with_signals(run, cfg, prompts, store, show):
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
        return await run(cfg, prompts, store, progress=show, stop=stop)
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.remove_signal_handler(sig)


os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
