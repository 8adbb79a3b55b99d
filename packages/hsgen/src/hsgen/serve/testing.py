"""Start a reference server for tests, benchmarks and scripts, and stop it cleanly.

Example::

    from hsgen.serve.testing import running_server

    with running_server("tiny", [1, 2, 4], tmp_path / "hs") as url:
        requests.post(f"{url}/v1/completions", json={...})   # url == "http://127.0.0.1:PORT"
        url.set_faults("http_500=1.0:1")                      # needs enable_admin (default here)
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from hsgen.protocol import extraction as protocol
from hsgen.serve.capacity import CapacityModel
from hsgen.serve.faults import FaultPlan

log = logging.getLogger(__name__)

_MODELS: dict[tuple[str, str, str, str | None], Any] = {}
_MODELS_LOCK = threading.Lock()


class ServerURL(str):
    """The base URL of a running server (a ``str``), with test controls.

    Attributes:
        model_name: the id to send as ``model``.
        shared_dir: the server's ``--shared-storage-path``.
        api_key: the key the server requires, or None.
    """

    model_name: str
    shared_dir: Path
    api_key: str | None

    def _admin(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        req = urllib.request.Request(
            f"{self}{path}",
            data=json.dumps(body).encode(),
            method="PUT",
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=30) as resp:
            return json.loads(resp.read())

    def set_faults(self, plan: str | FaultPlan | None) -> dict[str, Any]:
        """Replace the fault plan (``""``/None = no faults); returns the server's view of it."""
        text = plan.to_text() if isinstance(plan, FaultPlan) else (plan or "")
        return self._admin("/hsgen/faults", {"plan": text})

    def set_capacity(self, capacity: str | CapacityModel | None) -> dict[str, Any]:
        """Replace the capacity model (None = run as fast as possible)."""
        text = capacity.to_text() if isinstance(capacity, CapacityModel) else (capacity or "")
        return self._admin("/hsgen/capacity", {"capacity": text})


def _layers_text(layers: str | Sequence[int]) -> str:
    return layers if isinstance(layers, str) else ",".join(str(int(x)) for x in layers)


@contextlib.contextmanager
def running_server(
    model: str | os.PathLike[str],
    layers: str | Sequence[int],
    shared_dir: str | os.PathLike[str],
    *,
    capacity: str | CapacityModel | None = None,
    faults: str | FaultPlan | None = None,
    mode: str = "thread",
    api_key: str | None = None,
    vllm_version: str = "0.24",
    max_model_len: int | None = None,
    max_num_seqs: int = 256,
    max_num_batched_tokens: int = 8192,
    dtype: str = "auto",
    allow_custom_save_path: bool = False,
    served_model_name: str | None = None,
    torch_threads: int = 1,
    enable_admin: bool = True,
    enable_scale_out: bool = False,
    startup_timeout: float = 180.0,
) -> Iterator[ServerURL]:
    """Run ``hsgen serve`` on a free port of 127.0.0.1 for the duration of a ``with`` block.

    Args:
        model: ``"tiny"`` or a local HF causal-LM directory.
        layers: vLLM layer ids, e.g. ``[1, 2, 4]`` or ``"1,2,4"``.
        shared_dir: ``--shared-storage-path`` (created if missing).
        capacity: GPU-like time model (``CapacityModel`` or its text form), for benchmarks.
        faults: fault plan (``FaultPlan`` or text such as ``"http_500=0.5,seed=1"``).
        mode: ``"thread"`` (same process, fast start; loaded models are shared between
            servers of this process) or ``"process"`` (a ``python -m hsgen.cli serve`` child).
        api_key, vllm_version, max_model_len, max_num_seqs, max_num_batched_tokens, dtype,
        allow_custom_save_path, served_model_name, torch_threads, enable_admin, enable_scale_out:
            as the ``hsgen serve`` options of the same names.
        startup_timeout: seconds to wait for the server to accept connections.

    Yields:
        ServerURL: the base URL (``"http://127.0.0.1:PORT"``, no ``/v1``), also carrying
        ``model_name``, ``shared_dir``, ``api_key``, ``set_faults()`` and ``set_capacity()``.

    The server is stopped (pending file writes finished) when the block exits.
    """
    shared = Path(shared_dir)
    shared.mkdir(parents=True, exist_ok=True)
    opts: dict[str, Any] = {
        "model": os.fspath(model),
        "layers": _layers_text(layers),
        "shared_storage_path": str(shared),
        "host": "127.0.0.1",
        "port": 0,
        "served_model_name": served_model_name,
        "api_key": api_key,
        "max_model_len": max_model_len,
        "max_num_seqs": max_num_seqs,
        "max_num_batched_tokens": max_num_batched_tokens,
        "dtype": dtype,
        "vllm_version": vllm_version,
        "allow_custom_save_path": allow_custom_save_path,
        "torch_threads": torch_threads,
        "enable_admin": enable_admin,
        "enable_scale_out": enable_scale_out,
        "capacity": capacity.to_text() if isinstance(capacity, CapacityModel) else capacity,
        "faults": faults.to_text() if isinstance(faults, FaultPlan) else faults,
    }
    if mode == "thread":
        ctx = _thread_server(opts, startup_timeout)
    elif mode == "process":
        ctx = _process_server(opts, startup_timeout)
    else:
        raise ValueError(f"mode must be 'thread' or 'process', got {mode!r}")
    with ctx as base:
        url = ServerURL(base)
        url.model_name = served_model_name or os.fspath(model)
        url.shared_dir = shared
        url.api_key = api_key
        yield url


def _loaded_model(config) -> Any:
    from hsgen.serve.hidden import load_model

    key = (config.model, config.dtype, config.device, config.tiny_cache_dir)
    with _MODELS_LOCK:
        if key not in _MODELS:
            _MODELS[key] = load_model(
                config.model, dtype=config.dtype, device=config.device, tiny_cache_dir=config.tiny_cache_dir
            )
        return _MODELS[key]


@contextlib.contextmanager
def _thread_server(opts: dict[str, Any], startup_timeout: float) -> Iterator[str]:
    from hsgen.cli.serve import config_from_options
    from hsgen.serve.app import build_state
    from hsgen.serve.runner import ServerRunner

    config = config_from_options(dict(opts))
    state = build_state(config, _loaded_model(config))
    loop = asyncio.new_event_loop()
    ready = threading.Event()
    box: dict[str, Any] = {}

    def run() -> None:
        asyncio.set_event_loop(loop)
        runner = ServerRunner(state)
        try:
            box["url"] = loop.run_until_complete(runner.start(config.host, config.port))
        except BaseException as e:
            box["error"] = e
            ready.set()
            return
        box["runner"] = runner
        ready.set()
        loop.run_forever()
        loop.run_until_complete(runner.stop())
        loop.close()

    thread = threading.Thread(target=run, name="hsgen-serve", daemon=True)
    thread.start()
    if not ready.wait(startup_timeout) or "error" in box:
        raise RuntimeError(f"hsgen serve did not start: {box.get('error', 'timeout')}")
    try:
        yield box["url"]
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(60)


@contextlib.contextmanager
def _process_server(opts: dict[str, Any], startup_timeout: float) -> Iterator[str]:
    from hsgen.cli.serve import READY_PREFIX

    args = [sys.executable, "-m", "hsgen.cli", "serve"]
    for key, value in opts.items():
        flag = "--" + key.replace("_", "-")
        if value is None or value is False:
            continue
        if value is True:
            args.append(flag)
        else:
            args += [flag, str(value)]
    args += ["--log-level", "WARNING"]
    proc = subprocess.Popen(args, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    assert proc.stderr is not None
    lines: list[str] = []
    url: str | None = None
    deadline = time.monotonic() + startup_timeout
    try:
        while time.monotonic() < deadline:
            line = proc.stderr.readline()
            if not line:
                break
            if line.startswith(READY_PREFIX):
                url = line[len(READY_PREFIX) :].strip()
                break
            lines.append(line)
        if url is None:
            raise RuntimeError("hsgen serve exited before it was ready:\n" + "".join(lines[-30:]))
        drain = threading.Thread(target=_drain, args=(proc.stderr,), daemon=True)
        drain.start()
        yield url
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _drain(stream) -> None:
    for line in stream:
        sys.stderr.write(line)


def wait_for_file(path: str | os.PathLike[str], timeout: float = 30.0) -> None:
    """Block until the server finished writing ``path`` (its ``.lock`` released, file present)."""
    import fcntl

    deadline = time.monotonic() + timeout
    lock = protocol.lock_path(path)
    while time.monotonic() < deadline:
        if os.path.exists(lock):
            fd = os.open(lock, os.O_RDONLY)
            try:
                fcntl.flock(fd, fcntl.LOCK_SH)
            finally:
                os.close(fd)
        if os.path.exists(path):
            return
        time.sleep(0.01)
    raise TimeoutError(f"{path} was not written within {timeout} s")
