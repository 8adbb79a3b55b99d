#!/usr/bin/env python
"""What checking every sample's checksum costs a reader: the checksum alone, and store reads with and without it.

Writes a raw bf16 store at the reference layout (4 layers x 4096, so 32 KiB per token; samples
of 2048 tokens), then, on one thread, measures side by side and interleaved:

- ``checksum_gbps``: ``bsum64`` over a sample's bytes already in memory;
- ``read_gbps``: ``HiddenStateStore.read(verify=False)`` (page cache warm);
- ``verified_read_gbps``: ``HiddenStateStore.read(verify=True)``, the default;
- ``verify_overhead``: ``read_gbps / verified_read_gbps - 1`` (the two alternate which goes
  first each round; page faults of the fresh 64 MiB arrays make single rounds noisy);
- ``checksum_cost_fraction``: ``read_gbps / checksum_gbps``, the time the checksum adds to a
  read, from the two steadier figures.

Progress goes to stderr; the last stdout line is one JSON object with those keys, ``machine``
and the shape. ``--quick`` uses a smaller store and fewer rounds (well under a minute).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time

import numpy as np

from hsgen.store import HiddenStateStore, StoreHeader
from hsgen.store import codecs as C


def build_store(path, samples: int, tokens: int, layers: int, hidden: int) -> HiddenStateStore:
    header = StoreHeader("bench", tuple(range(layers)), hidden, "bfloat16")
    store = HiddenStateStore.create(path, header)
    rng = np.random.default_rng(0)
    with store.writer("bench", shard_bytes=256 << 20, fsync=False) as w:
        for i in range(samples):
            h = rng.integers(0, 1 << 16, size=(tokens, layers, hidden), dtype=np.uint16)
            w.add(f"s{i:05d}", h, rng.integers(0, 150000, tokens), np.ones(tokens, dtype=np.uint8))
    return store


def timed(fn, nbytes: int) -> float:
    t0 = time.perf_counter()
    fn()
    return nbytes / (time.perf_counter() - t0) / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small store, few rounds")
    ap.add_argument("--samples", type=int, default=None)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--rounds", type=int, default=None)
    args = ap.parse_args()
    samples = args.samples or (8 if args.quick else 64)
    rounds = args.rounds or (3 if args.quick else 7)
    layers, hidden = 4, 4096
    with tempfile.TemporaryDirectory(dir=os.environ.get("TMPDIR")) as tmp:
        print(f"writing {samples} samples of {args.tokens} tokens ...", file=sys.stderr)
        store = build_store(f"{tmp}/st", samples, args.tokens, layers, hidden)
        ids = store.sample_ids()
        nbytes = sum(store.read(i, verify=False).hidden_states.nbytes for i in ids)  # also warms the cache
        one = store.read(ids[0], verify=False)
        arrays = [one.hidden_states, one.token_ids, one.loss_mask]
        res = {"checksum": [], "read": [], "verified_read": []}
        for r in range(rounds):
            res["checksum"].append(timed(lambda: [C.checksum(arrays) for _ in ids], nbytes))
            order = ["read", "verified_read"] if r % 2 == 0 else ["verified_read", "read"]
            for kind in order:
                verify = kind == "verified_read"
                res[kind].append(timed(lambda v=verify: [store.read(i, verify=v) for i in ids], nbytes))
            print(f"round {r + 1}/{rounds}: " + ", ".join(f"{k} {v[-1]:.2f} GB/s" for k, v in res.items()),
                  file=sys.stderr)  # fmt: skip
        store.close()
    med = {k: statistics.median(v) for k, v in res.items()}
    out = {
        "checksum_gbps": round(med["checksum"], 3),
        "read_gbps": round(med["read"], 3),
        "verified_read_gbps": round(med["verified_read"], 3),
        "verify_overhead": round(med["read"] / med["verified_read"] - 1, 3),
        "checksum_cost_fraction": round(med["read"] / med["checksum"], 3),
        "sample_mib": round(args.tokens * layers * hidden * 2 / 2**20, 1),
        "samples": samples,
        "rounds": rounds,
        "machine": f"{platform.machine()} {os.cpu_count()} cpus, numpy {np.__version__}",
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
