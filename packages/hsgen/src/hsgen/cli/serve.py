"""``hsgen serve``: run the reference hidden-state server."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys

import click

from hsgen.protocol import extraction as protocol

READY_PREFIX = "hsgen serve: listening on "
"""Printed to stderr (then flushed) once the server accepts connections, followed by the URL."""


@click.command("serve", context_settings={"help_option_names": ["-h", "--help"], "show_default": True})
@click.option(
    "--model",
    required=True,
    help="The model to load, as in `vllm serve`: 'tiny' (built-in, built offline), a local HF causal-LM "
    "directory, or a Hugging Face model id (e.g. Qwen/Qwen3-8B: resolved in the HF cache first, honouring "
    "HF_HUB_OFFLINE and HF_HOME). Served under this name unless --served-model-name, so the same string "
    "passed as `hsgen generate --model` selects it.",
)
@click.option("--revision", default=None, help="Branch, tag or commit of a hub --model [default: main].")
@click.option(
    "--layer-ids",
    "--layers",
    "layers",
    required=True,
    help="vLLM layer ids to extract, e.g. '2,18,33,36' (L = last layer, pre-norm).",
)
@click.option(
    "--shared-dir",
    "--shared-storage-path",
    "shared_storage_path",
    default=protocol.DEFAULT_SHARED_STORAGE_PATH,
    help="Directory the files are written to (vLLM's shared_storage_path).",
)
@click.option("--host", default="127.0.0.1", help="Interface to bind (0.0.0.0 for all).")
@click.option("--port", default=8000, type=int, help="TCP port (0 = any free port).")
@click.option(
    "--served-model-name", default=None, help="Model id in /v1/models and requests [default: --model]."
)
@click.option(
    "--api-key", default=None, envvar="VLLM_API_KEY", help="Require 'Authorization: Bearer KEY' on /v1/*."
)
@click.option(
    "--max-model-len",
    default=None,
    type=int,
    help="Context length [default: the model's max_position_embeddings].",
)
@click.option(
    "--max-num-seqs", default=256, type=int, help="Most sequences in one forward step; the rest wait."
)
@click.option(
    "--max-num-batched-tokens", default=8192, type=int, help="Token budget of one forward step (padded)."
)
@click.option(
    "--dtype",
    default="auto",
    type=click.Choice(["auto", "bfloat16", "float16", "float32"]),
    help="Model dtype; auto resolves as vLLM does: the checkpoint's dtype, but float32 is served in "
    "bfloat16 where the device supports it (else float16).",
)
@click.option("--device", default="cpu", help="Torch device: cpu, cuda, cuda:1, ...")
@click.option(
    "--vllm-version",
    default="0.24",
    help="vLLM file/lock behaviour to imitate: 0.18-0.21, 0.22-0.23 or 0.24+.",
)
@click.option(
    "--allow-custom-save-path", is_flag=True, help="Honour kv_transfer_params.hidden_states_path (0.24+)."
)
@click.option("--num-writer-threads", default=4, type=int, help="Threads writing hidden-state files.")
@click.option(
    "--torch-threads",
    default=0,
    type=int,
    help="torch.set_num_threads for the forward (0 = torch's default).",
)
@click.option(
    "--capacity",
    default=None,
    help="GPU-like time model, e.g. 'tokens_per_s=20000,max_seqs=16' (benchmarks).",
)
@click.option("--faults", default=None, help="Fault injection, e.g. 'http_500=0.1,hang=1:2,seed=3' (tests).")
@click.option("--enable-admin", is_flag=True, help="Expose PUT /hsgen/faults and /hsgen/capacity (tests).")
@click.option(
    "--enable-scale-out",
    is_flag=True,
    help="Serve POST /v1/chat/completions/render, as vLLM's flag of that name (without it: 403, as vLLM).",
)
@click.option("--log-level", default="INFO", type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"]))
def serve(**opts) -> None:
    """Serve hidden states over vLLM's extraction protocol, computed with transformers.

    Behaves like `vllm serve MODEL` with the extract_hidden_states speculative method and
    ExampleHiddenStatesConnector (see docs/serve.md). Stop with Ctrl-C or SIGTERM.
    """
    from hsgen.log_format import setup_logging

    setup_logging(opts.pop("log_level"))
    config = config_from_options(opts)
    _need_serve_extra()
    from hsgen.serve.runner import bind

    try:  # before loading the model: a taken port fails in milliseconds
        sock = bind(config.host, config.port)
    except OSError as e:
        raise click.ClickException(
            f"cannot listen on {config.host}:{config.port}: {e.strerror or e} (pick another --port)"
        ) from None
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(_serve(config, sock))


def _need_serve_extra() -> None:
    """One line naming the fix when the server's dependencies are missing."""
    import importlib

    missing = []
    for name in ("torch", "transformers", "safetensors"):
        try:
            importlib.import_module(name)
        except ImportError:
            missing.append(name)
    if missing:
        raise click.ClickException(
            f"hsgen serve needs {', '.join(missing)} (not installed): pip install 'hsgen[serve]'"
        )


def config_from_options(opts: dict):
    """Build a :class:`ServeConfig` from the CLI options; bad values become click errors."""
    from hsgen.serve.capacity import CapacityModel
    from hsgen.serve.config import ServeConfig
    from hsgen.serve.faults import FaultPlan

    try:
        layer_ids = protocol.parse_layer_ids(opts.pop("layers"))
        # files are named by absolute path (clients refuse relative ones), whatever the cwd
        opts["shared_storage_path"] = os.path.abspath(opts["shared_storage_path"])
        capacity = opts.pop("capacity", None)
        faults = opts.pop("faults", None)
        config = ServeConfig(
            layer_ids=layer_ids,
            capacity=CapacityModel.parse(capacity) if capacity else None,
            faults=FaultPlan.parse(faults) if faults else None,
            **opts,
        )
        config.validate()
    except ValueError as e:
        raise click.BadParameter(str(e)) from None
    return config


async def _serve(config, sock=None) -> None:
    from hsgen.serve.app import build_state
    from hsgen.serve.runner import ServerRunner

    try:
        state = await asyncio.get_running_loop().run_in_executor(None, build_state, config)
    except (ValueError, FileNotFoundError) as e:
        raise click.ClickException(str(e)) from None
    except OSError as e:
        raise click.ClickException(f"{e.strerror or e}: {e.filename}" if e.filename else str(e)) from None
    runner = ServerRunner(state)
    url = await runner.start(config.host, config.port, sock=sock)
    print(f"{READY_PREFIX}{url}", file=sys.stderr, flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        logging.getLogger(__name__).info("shutting down")
        await runner.stop()
