"""Dead, silent or misconfigured servers end a run in seconds, with the cause on one line.

Issue 13, points 6 and 7.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time

from fake_vllm import FakeConfig, FakeVLLM

from hsgen.client.config import ClientConfig
from hsgen.generate.pipeline import EXIT_FAILURE, EXIT_INTERRUPTED, GenerateConfig, generate
from hsgen.inputs.render import RenderedPrompt
from hsgen.store import HiddenStateStore, StoreHeader


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tokens_file(path, n: int):
    path.write_text(
        "".join(json.dumps({"id": f"p{i}", "input_ids": [i + 1, i + 2, 3]}) + "\n" for i in range(n))
    )
    return path


def run_cli(*args, timeout=600, env=None):
    t0 = time.monotonic()
    r = subprocess.run(
        [sys.executable, "-m", "hsgen.cli", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )
    return r, time.monotonic() - t0


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.strip()]


def test_nothing_listening_fails_in_seconds_naming_url_and_cause(tmp_path):
    url = f"http://127.0.0.1:{free_port()}"
    r, took = run_cli(
        "generate", tokens_file(tmp_path / "d.jsonl", 5), "--store", tmp_path / "st", "--endpoint", url,
        "--layer-ids", "1,2,4", "--shared-dir", tmp_path, "--no-progress",
    )  # fmt: skip
    assert r.returncode == EXIT_FAILURE
    assert took < 120  # not --max-down (600 s) of retries; a start-up on 2 loaded cores takes tens of seconds
    lines = error_lines(r.stderr)
    assert len(lines) == 1, r.stderr
    assert url in lines[0] and "refused" in lines[0]
    assert "Traceback" not in r.stderr
    assert json.loads(r.stdout)["fatal"]


async def test_every_server_down_for_max_down_ends_the_run(tmp_path):
    shared = tmp_path / "shm"
    store = HiddenStateStore.create(tmp_path / "st", StoreHeader("fake-model", (1, 2, 4), 8, "float32"))
    fake = FakeVLLM(FakeConfig(str(shared), latency_s=0.01))
    url = await fake.__aenter__()
    served = 0

    async def prompts():
        nonlocal served
        for i in range(1000):
            if i == 10:
                await fake.__aexit__(None, None, None)  # the server dies mid-run and stays down
            served += 1
            yield RenderedPrompt(f"s{i}", [i + 1, 2, 3], [1, 1, 1])

    client = ClientConfig(
        endpoints=[url], shared_dir=str(shared), max_down_s=1.5, backoff_s=0.05, backoff_max_s=0.2,
        breaker_cooldown_s=0.2, request_timeout_s=5, file_wait_s=1,
    )  # fmt: skip
    cfg = GenerateConfig(client=client, shard_bytes=1024, max_consecutive_failures=0)
    t0 = time.monotonic()
    summary = await asyncio.wait_for(generate(cfg, prompts(), store, progress=False), 600)
    assert time.monotonic() - t0 < 120  # 1000 prompts against a dead server never end alone
    assert summary.exit_code == EXIT_FAILURE
    assert "no server has answered" in summary.fatal and "--max-down" in summary.fatal
    assert summary.stored >= 1 and served < 1000


def test_file_outside_shared_dir_stops_at_the_first_with_the_fix(tmp_path):
    shared, outside = tmp_path / "shm", tmp_path / "elsewhere"
    n = 20
    fake = FakeVLLM(FakeConfig(str(shared), faults=["outside"] * n, outside_dir=str(outside)))
    with fake.in_thread() as url:
        r, took = run_cli(
            "generate", tokens_file(tmp_path / "d.jsonl", n), "--store", tmp_path / "st", "--endpoint", url,
            "--layer-ids", "1,2,4", "--shared-dir", shared, "--no-progress", "--concurrency", "1",
        )  # fmt: skip
    assert r.returncode == EXIT_FAILURE
    lines = error_lines(r.stderr)
    assert len(lines) == 1, r.stderr
    assert "--shared-dir" in lines[0] and "outside" in lines[0]
    summary = json.loads(r.stdout)
    assert summary["failed"] == 1, "stopped at the first refused file"
    assert fake.requests == 1
    assert os.listdir(outside) == [], "the refused file (named after our request) is removed"


def start_generate(tmp_path, url, shared, n, *extra):
    """``hsgen generate`` of ``n`` prompts in a subprocess (stdout and stderr piped)."""
    cmd = [
        sys.executable, "-m", "hsgen.cli", "generate", str(tokens_file(tmp_path / "d.jsonl", n)),
        "--store", str(tmp_path / "st"), "--endpoint", url, "--layer-ids", "1,2,4",
        "--shared-dir", str(shared), "--no-progress", *map(str, extra),
    ]  # fmt: skip
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_for(cond, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def sigterm_and_wait(proc, *, twice: bool = False) -> tuple[float, str, str]:
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    if twice:
        time.sleep(0.5)
        proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=600)
    return time.monotonic() - t0, out, err


def test_sigterm_while_every_server_is_down_ends_at_once(tmp_path):
    """Requests waiting for a dead server to come back are not in flight: SIGTERM ends them now."""
    shared = tmp_path / "shm"
    fake = FakeVLLM(FakeConfig(str(shared), latency_s=0.02))
    with fake.in_thread() as url:
        proc = start_generate(tmp_path, url, shared, 5000)
        wait_for(lambda: fake.requests >= 30 or proc.poll() is not None)
    # the server is gone: every request fails, retries back off, the breaker opens and waits
    time.sleep(1.5)
    assert proc.poll() is None, proc.communicate()
    took, out, err = sigterm_and_wait(proc)
    assert proc.returncode == EXIT_INTERRUPTED, err[-2000:]
    assert took < 40, (
        f"{took:.1f} s: waiting for a dead server is not finishing a request"
    )  # not --max-down 600 s
    assert "Traceback" not in err
    summary = json.loads(out.splitlines()[-1])
    assert summary["failed"] == 0 or summary["failed"] < 30, summary
    store = HiddenStateStore.open(tmp_path / "st")
    assert len(store) == summary["stored"] >= 1


def test_sigterm_with_a_silent_server_ends_within_the_grace(tmp_path):
    """Requests a server never answers are cancelled after --stop-grace; a second SIGTERM at once."""
    shared = tmp_path / "shm"
    for twice, grace in ((False, 1.5), (True, 60)):
        run_dir = tmp_path / f"run-{twice}"
        run_dir.mkdir()
        cfg = FakeConfig(str(shared), faults=[None] * 10 + ["hang"] * 5000, hang_s=600)
        fake = FakeVLLM(cfg)
        with fake.in_thread() as url:
            proc = start_generate(run_dir, url, shared, 200, "--stop-grace", grace)
            wait_for(lambda f=fake, p=proc: f.requests >= 14 or p.poll() is not None)
            time.sleep(0.3)
            assert proc.poll() is None, proc.communicate()
            took, out, err = sigterm_and_wait(proc, twice=twice)
        assert proc.returncode == EXIT_INTERRUPTED, err[-2000:]
        assert took < (30 if twice else grace + 30), f"{took:.1f} s with --stop-grace {grace}, twice={twice}"
        assert "Traceback" not in err
        summary = json.loads(out.splitlines()[-1])
        assert summary["stored"] == 10 and summary["failed"] == 0, summary
        assert len(HiddenStateStore.open(run_dir / "st")) == 10


def test_sigterm_after_the_input_is_used_up_ends_within_the_grace(tmp_path):
    """Issue 21, hole 4: with every prompt sent, the run waits in its drain for the last requests;
    a SIGTERM there must still end it within --stop-grace (it used to wait for --timeout)."""
    shared = tmp_path / "shm"
    fake = FakeVLLM(FakeConfig(str(shared), faults=[None] * 10 + ["hang"] * 4, hang_s=600))
    with fake.in_thread() as url:
        proc = start_generate(tmp_path, url, shared, 14, "--stop-grace", 2)
        wait_for(lambda: fake.requests >= 14 or proc.poll() is not None)
        time.sleep(1.0)  # the input is used up: the run is draining
        assert proc.poll() is None, proc.communicate()
        took, out, err = sigterm_and_wait(proc)
    assert proc.returncode == EXIT_INTERRUPTED, err[-2000:]
    assert took < 2 + 30, f"{took:.1f} s with --stop-grace 2"
    assert "Traceback" not in err
    summary = json.loads(out.splitlines()[-1])
    assert summary["stored"] == 10 and summary["failed"] == 0, summary


def test_a_server_that_never_answers_a_request_ends_the_run_after_max_down(tmp_path):
    """Issue 21, hole 5: a server answering GET but never POST ended a run only after --timeout
    (600 s); no answer to anything for --max-down now ends it, in one line."""
    shared = tmp_path / "shm"
    fake = FakeVLLM(FakeConfig(str(shared), faults=["hang"] * 100, hang_s=600))
    with fake.in_thread() as url:
        r, took = run_cli(
            "generate", tokens_file(tmp_path / "d.jsonl", 5), "--store", tmp_path / "st", "--endpoint", url,
            "--layer-ids", "1,2,4", "--shared-dir", shared, "--no-progress", "--max-down", "3", timeout=600,
        )  # fmt: skip
    assert r.returncode == EXIT_FAILURE, r.stderr
    assert took < 120, f"{took:.1f} s with --max-down 3"
    assert "Traceback" not in r.stderr
    lines = [line for line in error_lines(r.stderr) if "--max-down 3" in line]
    assert len(lines) == 1 and "unanswered" in lines[0], r.stderr
