"""StopSignals: the first SIGINT / SIGTERM asks for a stop; the same signal delivered twice at once
(a scheduler signals the whole job and torchrun forwards it too) is one request; a later repeat aborts."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest

PROGRAM = """
import os, signal, sys, time
from spectrain.train.signals import StopSignals
with StopSignals(repeat_window_s=float(sys.argv[1])) as s:
    for _ in range(2):
        os.kill(os.getpid(), signal.{sig})
        time.sleep(0.2)
    print("stop requested by", s.signum, flush=True)
"""


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_the_same_signal_twice_at_once_is_one_stop(sig):
    r = subprocess.run([sys.executable, "-c", PROGRAM.format(sig=sig.name), "5"], capture_output=True, text=True,
                       timeout=120)  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == f"stop requested by {int(sig)}"
    assert r.stderr.count("stopping after this step") == 1


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_later_repeat_aborts_as_without_the_handler(sig):
    r = subprocess.run([sys.executable, "-c", PROGRAM.format(sig=sig.name), "0.1"], capture_output=True,
                       text=True, timeout=120)  # fmt: skip
    assert "stop requested" not in r.stdout
    assert r.returncode == -sig  # killed by it (an uncaught KeyboardInterrupt ends Python by SIGINT too)
    if sig == signal.SIGINT:
        assert "KeyboardInterrupt" in r.stderr
