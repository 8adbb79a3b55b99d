"""The options of ``hsgen generate``, in groups (``--help`` lists them in this order)."""

from __future__ import annotations

from pathlib import Path

import click

from hsgen.cli.render_options import apply_options, dataset_options, render_options

TARGET_OPTIONS = [  # the store and the servers
    click.option(
        "--store",
        "store_path",
        required=True,
        callback=lambda ctx, param, value: _store_location(ctx, param, value),
        help="The store directory, or s3://bucket/prefix on object storage (credentials and endpoint "
        "from the AWS_* variables); created if missing, resumed (existing ids skipped) if present.",
    ),
    click.option(
        "--endpoint",
        "endpoints",
        multiple=True,
        required=True,
        help="A server's base URL, e.g. http://localhost:8000 (a trailing /v1 is accepted). Repeat for "
        "several servers; each request goes to the least loaded one. A template names a node-local "
        "server per rank: http://localhost:{8000+local_rank}.",
    ),
    click.option(
        "--endpoint-per-local-rank",
        is_flag=True,
        help="Send this rank's requests only to the LOCAL_RANK-th --endpoint (modulo their number).",
    ),
    click.option(
        "--shared-dir",
        default="/tmp",
        show_default=True,
        help="The servers' shared_storage_path as seen from this machine. Files named outside it are refused.",
    ),
    click.option(
        "--api-key",
        envvar="VLLM_API_KEY",
        help="Bearer token for servers started with --api-key (default: $VLLM_API_KEY).",
    ),
    click.option(
        "--model",
        help="The served model id to request, as in vLLM's API: what `vllm serve`/`hsgen serve` got as --model "
        "(or --served-model-name) [default: each server's first GET /v1/models entry].",
    ),
    click.option(
        "--layer-ids",
        help="The layer ids the servers extract (their eagle_aux_hidden_state_layer_ids), e.g. '2,18,33,36'. "
        "Required to create a store; checked against an existing one.",
    ),
    click.option(
        "--verifier",
        help="The verifier: a model directory or hub id (its config.json gives a new store's hidden size, "
        "checked on every file's header before it is read; also --tokenizer's, or the served model's when "
        "that is a directory), or only a name, recorded in a new store's header (default: the served model id).",
    ),
    click.option(
        "--dtype",
        type=click.Choice(["bfloat16", "float16", "float32"]),
        help="The dtype the servers run (vllm serve --dtype), checked on every file's header before it is "
        "read. Default: the store's; a new store takes the servers' first file's.",
    ),
    click.option(
        "--codec",
        type=click.Choice(["raw", "lz4", "fp8"]),
        default="raw",
        show_default=True,
        help="Encoding of a new store: raw, lz4 (lossless) or fp8 (lossy e4m3 with per-token scale).",
    ),
    click.option(
        "--targets",
        type=click.Choice(["states", "argmax"]),
        default=None,
        help="What a new store keeps for the draft's targets: states (the last of --layer-ids is the "
        "verifier's final layer) or argmax (the verifier's greedy next token per position, from vLLM's "
        "prompt_logprobs, 4 bytes a token; --layer-ids then lists the draft's input layers only). "
        "Default: the store's own, states for a new one.",
    ),
]

SCALE_OPTIONS = [  # requests in flight, ranks, how much to do
    click.option(
        "--concurrency",
        type=click.IntRange(min=1),
        help="Fixed requests in flight per server. Default: adaptive (keep each server's queue just non-empty).",
    ),
    click.option(
        "--max-concurrency",
        type=click.IntRange(min=1),
        default=4096,
        show_default=True,
        help="Upper bound of the adaptive concurrency per server.",
    ),
    click.option(
        "--world-size",
        type=click.IntRange(min=1),
        help="Number of ranks (nodes/processes) filling one store; the input is split by a hash of the "
        "sample id. Default: from the launcher (HSGEN_WORLD_SIZE, torchrun's WORLD_SIZE, SLURM_NTASKS), else 1.",
    ),
    click.option(
        "--rank",
        type=click.IntRange(min=0),
        help="This process's rank, 0..world_size-1. Default: HSGEN_RANK, torchrun's RANK, SLURM_PROCID, else 0.",
    ),
    click.option(
        "--join",
        is_flag=True,
        help="Help the generators already filling this store (all started with --join): each claims "
        "chunks of the input in the store, so every prompt is requested once; a killed one's chunks "
        "are taken over. Without it a second generator on a store is refused.",
    ),
    click.option(
        "--join-chunk",
        type=click.IntRange(min=1),
        default=64,
        show_default=True,
        help="Prompts per claim with --join (the same for every joined generator).",
    ),
    click.option(
        "--failures",
        "failures_path",
        type=click.Path(dir_okay=False),
        help="JSONL file listing prompts that failed or were skipped, with the reason "
        "(default: <store>.failures.jsonl beside the store; .rank<R> added when --world-size > 1).",
    ),
    click.option(
        "--limit",
        type=click.IntRange(min=1),
        help="Request at most this many new samples (already stored ones are free).",
    ),
]

STORE_WRITE_OPTIONS = [
    click.option(
        "--shard-mb",
        type=click.FloatRange(min=0.001),
        default=32.0,
        show_default=True,
        help="Shard size to commit at.",
    ),
    click.option(
        "--commit-interval",
        type=click.FloatRange(min=0.1),
        default=60.0,
        show_default=True,
        help="Commit buffered samples at least this often (seconds), however few.",
    ),
    click.option(
        "--max-buffer-mb",
        type=click.FloatRange(min=1),
        default=1024.0,
        show_default=True,
        help="Memory bound: no new request starts while this much fetched data waits for the store.",
    ),
]

REQUEST_OPTIONS = [  # one request's limits, retries, breakers, what is checked and kept
    click.option(
        "--timeout",
        type=click.FloatRange(min=0.1),
        default=600.0,
        show_default=True,
        help="Limit for one HTTP request, queueing on the server included (seconds).",
    ),
    click.option(
        "--file-wait",
        type=click.FloatRange(min=0.0),
        default=60.0,
        show_default=True,
        help="How long the file or its .lock may take to appear after the response (vLLM >= 0.24 writes late).",
    ),
    click.option(
        "--lock-timeout",
        type=click.FloatRange(min=0.0),
        default=300.0,
        show_default=True,
        help="How long a server may hold a file's .lock before the attempt fails.",
    ),
    click.option(
        "--retries",
        type=click.IntRange(min=0),
        default=3,
        show_default=True,
        help="Extra attempts per prompt after a transient failure (transport, timeout, 5xx, bad file).",
    ),
    click.option(
        "--breaker-threshold",
        type=click.IntRange(min=1),
        default=5,
        show_default=True,
        help="Consecutive failures after which a server gets no requests for --breaker-cooldown seconds.",
    ),
    click.option(
        "--breaker-cooldown",
        type=click.FloatRange(min=0.0),
        default=10.0,
        show_default=True,
        help="Seconds an open circuit breaker waits before probing the server again.",
    ),
    click.option(
        "--max-down",
        type=click.FloatRange(min=0.0),
        default=600.0,
        show_default=True,
        help="End the run (exit 1) when no server has answered for this many seconds (0 = never give up).",
    ),
    click.option(
        "--stop-grace",
        type=click.FloatRange(min=0.0),
        default=30.0,
        show_default=True,
        help="After Ctrl-C or SIGTERM, how long requests already sent may finish before they are cancelled.",
    ),
    click.option(
        "--max-consecutive-failures",
        type=click.IntRange(min=0),
        default=200,
        show_default=True,
        help="Abort when this many prompts fail in a row (0 = never).",
    ),
    click.option(
        "--include-output-tokens",
        is_flag=True,
        help="Send kv_transfer_params.include_output_tokens (vLLM >= 0.24); the extra rows are dropped.",
    ),
    click.option(
        "--check-finite/--no-check-finite",
        default=True,
        show_default=True,
        help="Refuse samples with NaN or infinite hidden states.",
    ),
    click.option(
        "--keep-server-files",
        is_flag=True,
        help="Do not delete the servers' files and locks after reading (debugging; they accumulate).",
    ),
]

RUN_OPTIONS = [
    click.option("--writer-id", help="Store writer id (default: host-pid-random; reuse one to resume it)."),
    click.option(
        "--progress/--no-progress",
        default=None,
        help="Show a progress bar on stderr (default: when stderr is a terminal).",
    ),
]


def _store_location(ctx, param, value):
    """A store path (``Path``), or an ``s3://`` URL kept as a string."""
    from hsgen.store.backend import is_remote

    if value is None or is_remote(value):
        return value
    return click.Path(file_okay=False, path_type=Path).convert(value, param, ctx)


def generate_options(f):
    """Every option of ``hsgen generate`` (after its INPUTS argument)."""
    f = apply_options(f, [*SCALE_OPTIONS, *STORE_WRITE_OPTIONS, *REQUEST_OPTIONS, *RUN_OPTIONS])
    f = render_options(f)
    f = apply_options(f, TARGET_OPTIONS)
    return dataset_options(f)
