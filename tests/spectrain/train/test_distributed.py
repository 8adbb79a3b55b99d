"""Host-side collectives go over the gloo control group, never NCCL (which a CPU machine cannot run)."""

from __future__ import annotations

import torch.distributed as dist

from spectrain.train.distributed import DistInfo, gather


def test_gather_uses_the_control_group(monkeypatch):
    control = object()  # the gloo group init_distributed makes beside an NCCL default group
    seen = {}

    def all_gather_object(out, obj, group=None):
        seen["group"] = group
        out[:] = [obj] * len(out)

    monkeypatch.setattr(dist, "all_gather_object", all_gather_object)
    assert gather({"position": 3}, DistInfo(rank=0, world_size=2, control=control)) == [{"position": 3}] * 2
    assert seen["group"] is control
    assert gather(7, DistInfo()) == [7]  # one process: no collective


def test_exit_code_of_says_what_click_would():
    import click

    from hsgen.cli.toolkit import exit_code_of

    def body(outcome):
        if isinstance(outcome, BaseException):
            raise outcome

    assert exit_code_of(body, None) == 0
    assert exit_code_of(body, SystemExit(3)) == 3 and exit_code_of(body, SystemExit(None)) == 0
    assert exit_code_of(body, SystemExit("a message")) == 1
    assert exit_code_of(body, click.ClickException("bad store")) == 1
    assert exit_code_of(body, click.UsageError("--lr: not a number")) == 2
    assert exit_code_of(body, KeyboardInterrupt()) == 130
    assert exit_code_of(body, RuntimeError("a bug")) == 1


def test_exit_process_flushes_and_exits_with_the_code():
    import subprocess
    import sys

    program = ("import atexit, sys; from spectrain.train.distributed import exit_process; "
               "atexit.register(lambda: print('exit handler ran', file=sys.stderr)); "
               "print('summary', end=''); exit_process(143)")  # fmt: skip
    r = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=120)
    assert r.returncode == 143 and r.stdout == "summary" and "exit handler ran" in r.stderr
