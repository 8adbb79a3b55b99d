#!/usr/bin/env python
"""CI smoke of the benchmarks: each ``scripts/bench_*.py --quick`` once, so none can rot.

A benchmark passes when it exits 0 within ``--timeout`` seconds and its last stdout line is a JSON
object with at least one key (no figure is asserted: CI's machine is too noisy for that). A
benchmark that measured nothing must exit non-zero and say why on stderr, so it fails here. A
helper module of another benchmark (no ``__main__``) runs through the command that uses it
(``bench_object_store``: ``bench_loader.py --quick --store-url moto``). Prints one line per
benchmark (seconds, keys; the tail of its stderr when it failed) on stderr, then one line naming
every failure, and a JSON object as the last stdout line: ``total_s``, ``failed``, each
benchmark's wall seconds (``seconds``) and CPU seconds of its processes (``cpu_s``: what the
neighbours' load moves far less), and the load average at the end. Exit status 1 when any
benchmark failed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
# helper modules (no __main__) and the command line, after the interpreter, that runs each
HOSTED = {"bench_object_store": ["bench_loader.py", "--quick", "--store-url", "moto"]}


def last_json(stdout: str) -> dict | None:
    lines = [line for line in stdout.splitlines() if line.strip()]
    try:
        value = json.loads(lines[-1]) if lines else None
    except json.JSONDecodeError:
        return None
    return value if isinstance(value, dict) and value else None


def benchmarks() -> dict[str, list[str]]:
    """Every benchmark's name and command line (after the interpreter), in name order."""
    out = {}
    for p in sorted(HERE.glob("bench_*.py")):
        if p.name == Path(__file__).name:
            continue
        if "__main__" in p.read_text():
            out[p.stem] = [str(p), "--quick"]
        elif p.stem in HOSTED:
            out[p.stem] = [str(HERE / HOSTED[p.stem][0]), *HOSTED[p.stem][1:]]
    return out


def run_one(cmd: list[str], timeout: float) -> tuple[int | str, str, str]:
    """``(exit status or "timeout", stdout, stderr)``; on timeout the benchmark's whole process
    group is killed (its servers too), so nothing it started outlives the smoke."""
    proc = subprocess.Popen([sys.executable, *cmd], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)  # fmt: skip
    try:
        out, err = proc.communicate(timeout=timeout)
        code: int | str = proc.returncode
    except subprocess.TimeoutExpired:
        code = "timeout"
        out, err = "", ""
    finally:
        with contextlib.suppress(ProcessLookupError):  # whatever it left behind (a server, a worker)
            os.killpg(proc.pid, signal.SIGKILL)
        if code == "timeout":
            out, err = proc.communicate()
    return code, out, err


def _children_cpu_s() -> float:
    """User + system CPU seconds of every finished (waited-for) descendant so far."""
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", nargs="*", help="benchmark names (e.g. bench_store); default all")
    ap.add_argument("--skip", nargs="*", default=[], help="benchmark names left out (run elsewhere)")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds each benchmark may take")
    args = ap.parse_args()
    known = benchmarks()
    unknown = sorted((set(args.only or []) | set(args.skip)) - set(known))
    if unknown:
        ap.error(f"no such benchmark: {', '.join(unknown)} (known: {', '.join(known)})")
    names = [n for n in known if (not args.only or n in args.only) and n not in args.skip]
    seconds: dict[str, float] = {}
    cpu: dict[str, float] = {}
    failed: list[str] = []
    t_all = time.monotonic()
    for name in names:
        t0, c0 = time.monotonic(), _children_cpu_s()
        code, out, err = run_one(known[name], args.timeout)
        took = seconds[name] = round(time.monotonic() - t0, 1)
        cpu[name] = round(_children_cpu_s() - c0, 1)
        result = last_json(out) if code == 0 else None
        shown = " ".join(Path(known[name][0]).name if i == 0 else a for i, a in enumerate(known[name]))
        if result is None:
            failed.append(name)
            why = f"ran past {args.timeout:.0f} s" if code == "timeout" else f"exit {code} after {took} s"
            tail = "\n".join("    " + line for line in err.strip().splitlines()[-8:])
            print(f"FAIL {shown}: {why}, last stdout line {(out.strip().splitlines() or [''])[-1][:200]!r}\n{tail}",
                  file=sys.stderr, flush=True)  # fmt: skip
        else:
            print(
                f"ok   {shown}: {took} s ({cpu[name]} CPU s), keys {sorted(result)}",
                file=sys.stderr,
                flush=True,
            )
    total = round(time.monotonic() - t_all, 1)
    if failed:
        print(f"benchmark smoke FAILED: {', '.join(failed)} ({len(failed)} of {len(names)}; see above)",
              file=sys.stderr, flush=True)  # fmt: skip
    else:
        print(f"benchmark smoke passed: {len(names)} benchmarks in {total} s", file=sys.stderr, flush=True)
    print(json.dumps({"total_s": total, "failed": failed, "seconds": seconds, "cpu_s": cpu,
                      "load_average": [round(x, 1) for x in os.getloadavg()]}))  # fmt: skip
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
