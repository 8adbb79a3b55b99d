"""Errors a user can cause end with one line on stderr, a non-zero exit code and no traceback.

Issue 13, point 9: permission denied on input and output paths, a disk full (naming the path),
a port already in use, missing optional packages (with the ``pip install`` hint), unreachable or
unauthorised servers. When the tests run as root, the permission cases drop the capabilities
that let root ignore file modes (``setpriv``).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from hsgen.serve.testing import running_server


@pytest.fixture()
def box():
    """A scratch directory with a read-only corner and an unreadable input."""
    d = Path(tempfile.mkdtemp(prefix="hsgen-user-errors-"))
    d.chmod(0o777)
    (d / "ro").mkdir()
    (d / "ro").chmod(0o555)
    good = d / "good.jsonl"
    good.write_text("".join(json.dumps({"id": f"g{i}", "input_ids": [i + 1, 2, 3]}) + "\n" for i in range(3)))
    good.chmod(0o644)
    secret = d / "secret.jsonl"
    secret.write_text(good.read_text())
    secret.chmod(0o000)
    yield d
    (d / "ro").chmod(0o755)
    shutil.rmtree(d, ignore_errors=True)


def run(*args, module="hsgen.cli", denied=False, env=None, timeout=600):
    """Run a CLI; with ``denied``, file modes apply even when the tests run as root (the process
    loses the capabilities that let root read and write anything)."""
    cmd = [sys.executable, "-m", module, *map(str, args)]
    if denied and os.geteuid() == 0:
        cmd = ["setpriv", "--bounding-set=-dac_override,-dac_read_search", *cmd]
    return subprocess.run(
        cmd, capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})}
    )


def one_line(r, code: int = 1) -> str:
    """The single stderr line of a failed run (asserts the exit code and that there is no traceback)."""
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert r.returncode == code, (r.returncode, r.stderr)
    assert "Traceback" not in r.stderr, r.stderr
    assert len(lines) == 1, r.stderr
    return lines[0]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def generate_args(data, store, url, shared, *extra):
    return ["generate", data, "--store", store, "--endpoint", url, "--shared-dir", shared, "--layer-ids", "1,2,4",
            "--no-progress", *extra]  # fmt: skip


def test_hsgen_paths_servers_and_disk(box):
    shared = box / "shm"
    key = {"VLLM_API_KEY": "right"}
    with running_server("tiny", [1, 2, 4], shared, api_key="right") as url:
        os.chmod(shared, 0o777)
        r = run(*generate_args(box / "secret.jsonl", box / "st", url, shared), denied=True, env=key)
        line = one_line(r)
        assert "Permission denied" in line and str(box / "secret.jsonl") in line
        r = run(*generate_args(box / "good.jsonl", box / "ro" / "st", url, shared), denied=True, env=key)
        line = one_line(r)
        assert "Permission denied" in line and str(box / "ro" / "st") in line
        r = run(*generate_args(box / "good.jsonl", box / "st2", url, shared, "--failures", box / "ro" / "f.jsonl"),
                denied=True, env=key)  # fmt: skip
        line = one_line(r)
        assert "failures file" in line and "Permission denied" in line and str(box / "ro" / "f.jsonl") in line
        bad = box / "bad.jsonl"
        bad.write_text('{"id": "x", "oops": 1}\n' + (box / "good.jsonl").read_text())
        r = run(*generate_args(bad, box / "st3", url, shared, "--on-bad-input", "skip", "--failures", "/dev/full",
                               "--log-level", "ERROR"), env=key)  # fmt: skip
        line = one_line(r)
        assert "No space left on device" in line and "/dev/full" in line
        line = one_line(run(*generate_args(box / "good.jsonl", box / "st4", url, shared)))
        assert url in line and "401" in line and "--api-key" in line
    dead = f"http://127.0.0.1:{free_port()}"
    line = one_line(run(*generate_args(box / "good.jsonl", box / "st", dead, shared)))
    assert dead in line and "refused" in line
    chat = box / "chat.jsonl"
    chat.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    line = one_line(run("render", chat, "--server", dead))
    assert dead in line
    line = one_line(run("render", box / "good.jsonl", "-o", box / "ro" / "out.jsonl", denied=True))
    assert "Permission denied" in line and str(box / "ro" / "out.jsonl") in line
    line = one_line(run("render", box / "good.jsonl", "-o", "/dev/full"))
    assert "No space left on device" in line and "/dev/full" in line


def test_port_in_use_and_missing_packages(box, tiny_model_dir):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        line = one_line(run("serve", "--model", tiny_model_dir, "--layers", "1,2,4", "--port", port))
        assert f"127.0.0.1:{port}" in line and "in use" in line and "--port" in line
    blocked = box / "blocked"
    for name in ("torch", "pyarrow", "tokenizers"):
        (blocked / name).mkdir(parents=True)
        (blocked / name / "__init__.py").write_text(f'raise ImportError("No module named {name}")\n')
    env = {"PYTHONPATH": f"{blocked}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    line = one_line(run("serve", "--model", "tiny", "--layers", "1,2,4", env=env))
    assert "torch" in line and "pip install 'hsgen[serve]'" in line
    parquet = box / "d.parquet"
    parquet.write_bytes(b"PAR1")
    line = one_line(run("render", parquet, env=env))
    assert "pip install 'hsgen[parquet]'" in line and str(parquet) in line
    line = one_line(run("render", box / "good.jsonl", "--tokenizer", tiny_model_dir, env=env))
    assert "pip install 'hsgen[render]'" in line


def test_spectrain_paths_and_servers(box, tiny_model_dir):
    base = ["train", "--verifier", tiny_model_dir, "--max-steps", "1"]
    r = run(
        *base,
        "--store",
        box / "nope",
        "--save-path",
        box / "ro" / "run",
        module="spectrain.cli",
        denied=True,
    )
    line = one_line(r)
    assert "Permission denied" in line and str(box / "ro" / "run") in line
    line = one_line(run(*base, "--store", box / "nope", "--save-path", box / "run", module="spectrain.cli"))
    assert f"{box / 'nope'}: not an hsgen store" in line
    dead = f"http://127.0.0.1:{free_port()}"
    r = run(*base, "--online", "--endpoint", dead, "--prompts", box / "good.jsonl", "--save-path", box / "run2",
            "--online-option", "layer_ids=[1,2,3,4]", module="spectrain.cli", timeout=600)  # fmt: skip
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    errors = [line for line in r.stderr.splitlines() if dead in line]
    assert len(errors) == 1 and "refused" in errors[0] and r.stderr.strip().splitlines()[-1] == errors[0]


def test_online_against_a_server_that_never_answers_ends_after_max_down(box, tiny_model_dir):
    """Issue 21, hole 5: the first-sample probe counted fatal errors as skips (8 in a row, up to
    600 s each) and ended in a traceback; now --max-down ends the run in one line."""
    import time

    with running_server(tiny_model_dir, [1, 2, 3, 4], box / "hs", dtype="float32") as url:
        url.set_faults("hang=1.0,hang_s=900")
        t0 = time.monotonic()
        r = run("train", "--verifier", tiny_model_dir, "--max-steps", "1", "--online", "--endpoint", url,
                "--prompts", box / "good.jsonl", "--save-path", box / "run", "--shared-dir", box / "hs",
                "--online-option", "layer_ids=[1,2,3,4]", "--max-down", "3", module="spectrain.cli",
                timeout=600)  # fmt: skip
        took = time.monotonic() - t0
        url.set_faults(None)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert "--max-down 3" in r.stderr.strip().splitlines()[-1], r.stderr
    assert took < 400, f"{took:.0f} s"  # not 8 requests of --timeout (600 s) each
