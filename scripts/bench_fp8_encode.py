#!/usr/bin/env python3
"""Time the fp8 codec's encode: ``encode_fp8`` against the ml_dtypes cast it replaced, in one run.

For each storage dtype the same sample (``--tokens`` x 4 layers x ``--hidden``, standard normal
values; float16 2048 x 4 x 1024 is one ingest file of ``bench_generate.py``) is encoded by the old
code (float32 copy, ``abs().max()``, divide, ``astype(float8_e4m3fn)``, kept here as it was) and by
``hsgen.store.codecs.encode_fp8``, interleaved rep by rep (which goes first alternates); every rep
checks that both give the same bytes and scales. Rates are GB/s of storage-dtype input (1e9
bytes/s) from wall time; the speedup in process CPU time (steadier on a shared machine) is
reported too. Progress goes to stderr; the last stdout line is one JSON object: per dtype the
median old and new GB/s and the speedups. Exits non-zero when nothing was timed or the
bytes differ.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import numpy as np

from hsgen.store.codecs import FP8_DTYPE, FP8_MAX, encode_fp8
from hsgen.store.header import LOGICAL_DTYPES, STORAGE_DTYPES


def old_encode_fp8(hidden: np.ndarray, dtype: str) -> tuple[np.ndarray, np.ndarray]:
    """``encode_fp8`` before issue 33 (the reference the new one must match bit for bit)."""
    x = hidden.view(LOGICAL_DTYPES[dtype]).astype(np.float32)
    amax = np.abs(x).max(axis=-1)
    if not np.isfinite(amax).all():
        raise ValueError("fp8 codec needs finite hidden states; found inf or nan")
    scale = np.where(amax > 0, amax / FP8_MAX, 1.0).astype(np.float32)
    x /= scale[..., None]
    return x.astype(FP8_DTYPE).view(np.uint8), scale


def timed(fn, hidden, dtype) -> tuple[float, float, tuple]:
    c0, t0 = time.process_time(), time.perf_counter()
    out = fn(hidden, dtype)
    return time.perf_counter() - t0, time.process_time() - c0, out


def bench(dtype: str, tokens: int, hidden_size: int, reps: int) -> dict:
    rng = np.random.default_rng(0)
    values = rng.standard_normal((tokens, 4, hidden_size), dtype=np.float32)
    hidden = values.astype(LOGICAL_DTYPES[dtype]).view(STORAGE_DTYPES[dtype])
    order = [
        ("old", old_encode_fp8),
        ("new", encode_fp8),
    ]
    rates: dict[str, dict[str, list[float]]] = {k: {"wall": [], "cpu": []} for k, _ in order}
    for rep in range(reps):
        results = {}
        for name, fn in order if rep % 2 == 0 else order[::-1]:
            wall, cpu, results[name] = timed(fn, hidden, dtype)
            rates[name]["wall"].append(hidden.nbytes / wall / 1e9)
            rates[name]["cpu"].append(hidden.nbytes / max(cpu, 1e-9) / 1e9)
        q_old, s_old = results["old"]
        q_new, s_new = results["new"]
        if not (np.array_equal(q_old, q_new) and np.array_equal(s_old, s_new)):
            print(f"bench_fp8_encode: {dtype} rep {rep}: the new encode's bytes differ", file=sys.stderr)
            sys.exit(2)
    med = {k: {m: statistics.median(v) for m, v in r.items()} for k, r in rates.items()}
    row = {"mib": round(hidden.nbytes / 2**20, 1)}
    for name, _ in order:
        row[f"{name}_gbps"] = round(med[name]["wall"], 3)
    row["speedup"] = round(med["new"]["wall"] / med["old"]["wall"], 2)
    row["speedup_cpu"] = round(med["new"]["cpu"] / med["old"]["cpu"], 2)
    row["reps_wall_gbps"] = {k: [round(x, 3) for x in r["wall"]] for k, r in rates.items()}
    print(f"{dtype} {tokens}x4x{hidden_size}: {json.dumps(row)}", file=sys.stderr)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="5 reps per dtype (well under a minute on 2 cores)")
    ap.add_argument("--reps", type=int, default=None, help="reps per dtype (default 15, 5 with --quick)")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--dtypes", default="float16,bfloat16,float32")
    args = ap.parse_args()
    reps = args.reps or (5 if args.quick else 15)
    out = {}
    for dtype in args.dtypes.split(","):
        out[dtype] = bench(dtype, args.tokens, args.hidden, reps)
    if not out or reps < 1:
        print("bench_fp8_encode: nothing timed", file=sys.stderr)
        sys.exit(1)
    print(json.dumps({d: {k: r[k] for k in r if k != "reps_wall_gbps"} for d, r in out.items()}))


if __name__ == "__main__":
    main()
