#!/usr/bin/env python
"""CI smoke of the benchmarks: each ``scripts/bench_*.py --quick`` once, so none can rot.

A benchmark passes when it exits 0 and its last stdout line is a JSON object with at least one
key (no figure is asserted: CI's machine is too noisy for that). A benchmark that measured
nothing must exit non-zero and say why on stderr, so it fails here. Prints one line per
benchmark (seconds, keys) on stderr, then a JSON object as the last stdout line: ``total_s``,
``failed`` and each benchmark's seconds.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def last_json(stdout: str) -> dict | None:
    lines = [line for line in stdout.splitlines() if line.strip()]
    try:
        value = json.loads(lines[-1]) if lines else None
    except json.JSONDecodeError:
        return None
    return value if isinstance(value, dict) and value else None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", nargs="*", help="benchmark names (e.g. bench_store); default all")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds each benchmark may take")
    args = ap.parse_args()
    scripts = sorted(  # a helper module of another benchmark (no __main__) is not one itself
        p for p in HERE.glob("bench_*.py") if p.name != Path(__file__).name and "__main__" in p.read_text()
    )
    if args.only:
        scripts = [p for p in scripts if p.stem in set(args.only)]
    seconds: dict[str, float] = {}
    failed: list[str] = []
    t_all = time.monotonic()
    for script in scripts:
        t0 = time.monotonic()
        try:
            r = subprocess.run([sys.executable, str(script), "--quick"], capture_output=True, text=True,
                               timeout=args.timeout)  # fmt: skip
            code, out, err = r.returncode, r.stdout, r.stderr
        except subprocess.TimeoutExpired as e:
            code, out, err = "timeout", "", (e.stderr or b"").decode(errors="replace") if e.stderr else ""
        took = seconds[script.stem] = round(time.monotonic() - t0, 1)
        result = last_json(out) if code == 0 else None
        if result is None:
            failed.append(script.stem)
            tail = "\n".join(err.strip().splitlines()[-5:])
            print(f"FAIL {script.name} --quick: exit {code} after {took} s, last stdout line "
                  f"{(out.strip().splitlines() or [''])[-1][:200]!r}\n{tail}", file=sys.stderr, flush=True)  # fmt: skip
        else:
            print(f"ok   {script.name} --quick: {took} s, keys {sorted(result)}", file=sys.stderr, flush=True)
    print(json.dumps({"total_s": round(time.monotonic() - t_all, 1), "failed": failed, "seconds": seconds}))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
