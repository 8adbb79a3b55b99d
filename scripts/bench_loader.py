#!/usr/bin/env python
"""The loader against the machine's raw read limit: store -> packed (pinned) sequence, side by side.

A store at the reference layout (3 auxiliary + 1 target layer x 4096, bf16, raw codec) is written
once; then, interleaved and repeated in one run:

- *raw*: ``preadv`` of exactly the bytes the loader reads (each sample's hidden-state rows,
  token ids and loss mask, byte ranges from ``docs/format.md``), in plan order, into one reused
  buffer of a packed sequence (page-locked when CUDA exists, else preallocated): one thread,
  and ``--threads`` threads splitting the samples; the better of the two is the raw limit;
- *loader*: :class:`spectrain.data.sources.PackedLoader` over :class:`spectrain.data.sources.StoreSource`,
  every batch of 8192-token sequences, with each sample's checksum checked (the default) and
  without.

``loader_ratio`` is the median over repeats of (loader with checks) / (raw limit of the same
repeat). Finally a simulated training step (a sleep 1.5x as long as the loader needs per
sequence, standing for GPU work) shows the overlap: ``overlap_wait_fraction`` is the share of
step time spent waiting for data after the first sequence (near 0 when the loader is hidden).

Each timed pass also counts this process's CPU seconds per GB (``cpu_s_per_gb``;
``cpu_ratio``: the threaded raw read's over the checked loader's), which the neighbours' load
moves far less than it moves the rates.

Last stdout line: ``{"loader_gbps", "loader_ratio", "raw_gbps", "loader_gbps_noverify",
"loader_ratio_noverify", "overlap_wait_fraction", "cpu_s_per_gb", "cpu_ratio", ...}``. ``bench_loader()`` is importable
(``scripts/bench_train.py`` calls it).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import resource
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from shm import scratch_root  # scripts/shm.py

log = logging.getLogger("bench_loader")

LAYERS = (2, 18, 33, 36)
HIDDEN = 4096


def _lengths(total_tokens: int, seed: int = 0) -> list[int]:
    """Sample lengths of a chat dataset (log-normal around ~1.5k tokens, 64..8192)."""
    rng = np.random.default_rng(seed)
    out: list[int] = []
    while sum(out) < total_tokens:
        out.append(int(np.clip(rng.lognormal(7.2, 0.7), 64, 8192)))
    return out


def write_store(path: Path, total_tokens: int, hidden: int = HIDDEN):
    """A raw bf16 store of ~``total_tokens`` tokens at the reference layout (finite values)."""
    from hsgen.store import HiddenStateStore, StoreHeader

    header = StoreHeader(verifier="bench", layer_ids=LAYERS, hidden_size=hidden, dtype="bfloat16")
    store = HiddenStateStore.create(path, header)
    rng = np.random.default_rng(1)
    row = len(LAYERS) * hidden
    base = (rng.standard_normal(row * 64, dtype=np.float32).view(np.uint32) >> 16).astype(np.uint16)
    with store.writer("bench", shard_bytes=256 << 20, fsync=False) as w:
        for i, n in enumerate(_lengths(total_tokens)):
            hs = np.resize(np.roll(base, i), n * row).reshape(n, len(LAYERS), hidden)
            w.add(f"b{i:06d}", hs, rng.integers(0, 150_000, n), (rng.random(n) < 0.7).astype(np.uint8))
    store.refresh()
    return store


class RawReader:
    """preadv of each sample's bytes (hidden rows, token ids, loss mask) into one reused buffer."""

    def __init__(self, store, plan: list[str], seq: int):
        self.store = store
        self.row = store.header.num_layers * store.header.hidden_size * 2
        self.fds: dict[str, int] = {}
        self.spans = []
        for sid in plan:
            r = store.record(sid)
            n = min(r.length, seq)
            self.spans.append(
                [
                    (self._fd(r.shard, "hidden_states/c/0/0/0"), r.offset * self.row, n * self.row),
                    (self._fd(r.shard, "token_ids/c/0"), r.offset * 8, n * 8),
                    (self._fd(r.shard, "loss_mask/c/0"), r.offset, n),
                ]
            )
        self.nbytes = sum(size for spans in self.spans for _, _, size in spans)
        self.buffers = [self._buffer(seq) for _ in range(2)]

    def _fd(self, shard: str, rel: str) -> int:
        key = f"{shard}/{rel}"
        if key not in self.fds:
            self.fds[key] = os.open(self.store.path / key, os.O_RDONLY)
        return self.fds[key]

    def _buffer(self, seq: int) -> memoryview:
        t = torch.empty(seq * (self.row + 9), dtype=torch.uint8, pin_memory=torch.cuda.is_available())
        t.fill_(0)  # touch every page once, as a reused buffer is
        return memoryview(t.numpy())

    def read(self, part: slice = slice(None), buf: int = 0) -> None:
        view = self.buffers[buf]
        for spans in self.spans[part]:
            at = 0
            for fd, offset, size in spans:
                done = 0
                while done < size:
                    n = os.preadv(fd, [view[at + done : at + size]], offset + done)
                    if n <= 0:
                        raise EOFError("short read")
                    done += n
                at += size

    def read_threads(self, threads: int) -> None:
        """The samples split into ``threads`` contiguous parts, read at once (one buffer each)."""
        if threads <= 1:
            return self.read()
        while len(self.buffers) < threads:
            self.buffers.append(self._buffer(len(self.buffers[0]) // (self.row + 9)))
        k = -(-len(self.spans) // threads)
        with ThreadPoolExecutor(threads) as pool:  # a thread's error raised here, not lost with it
            jobs = [pool.submit(self.read, slice(i * k, (i + 1) * k), i) for i in range(threads)]
        for job in jobs:
            job.result()

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)


_BUFFERS = None


def _loader(store_path: Path, plan: list[str], seq: int, threads: int, verify: bool):
    """The loader as training builds it (one buffer pool for the whole run, as the trainer keeps)."""
    global _BUFFERS
    from spectrain.data.loader import BufferPool, PackedLoader
    from spectrain.data.sources import StoreSource

    _BUFFERS = _BUFFERS or BufferPool()
    src = StoreSource(store_path, val_fraction=0.0, verify=verify)
    return PackedLoader(src, plan, total_seq_len=seq, layers=[0, 1, 2, 3], hidden_dtype=torch.bfloat16,
                        pin_memory=torch.cuda.is_available(), read_threads=threads, buffers=_BUFFERS)  # fmt: skip


def _time_loader(store_path: Path, plan: list[str], seq: int, threads: int, verify: bool) -> float:
    t0 = time.perf_counter()
    n = 0
    for b in _loader(store_path, plan, seq, threads, verify):
        n += b.num_tokens
    return time.perf_counter() - t0


def overlap_wait_fraction(store_path: Path, plan: list[str], seq: int, threads: int, step_s: float) -> float:
    """Share of a simulated step loop spent waiting for data (first sequence left out)."""
    waits, totals = [], []
    it = iter(_loader(store_path, plan, seq, threads, True))
    while True:
        t0 = time.perf_counter()
        b = next(it, None)
        if b is None:
            break
        wait = time.perf_counter() - t0
        time.sleep(step_s)  # the GPU's forward, backward and optimizer step
        waits.append(wait)
        totals.append(time.perf_counter() - t0)
    return sum(waits[1:]) / max(sum(totals[1:]), 1e-9)


def bench_loader(
    *, quick: bool = False, directory: str | None = None, threads: int = 2, repeats: int | None = None,
    tokens: int | None = None, seq: int = 8192,
) -> dict:  # fmt: skip
    """Run the comparison (see the module docstring); returns the result dict."""
    repeats = repeats or (3 if quick else 5)
    tokens = tokens or (24_000 if quick else 96_000)  # quick: still ~15 samples (0.8 GB) per pass
    base = directory or scratch_root(3 * tokens * 4 * 4096 * 2)
    with tempfile.TemporaryDirectory(prefix="bench-loader-", dir=base) as tmp:
        path = Path(tmp) / "store"
        t0 = time.perf_counter()
        store = write_store(path, tokens)
        from spectrain.data.sources import StoreSource

        plan = StoreSource(path, val_fraction=0.0).plan(0)
        raw = RawReader(store, plan, seq)
        gb = raw.nbytes / 1e9
        log.info("store: %d samples, %.2f GB in %.1f s (%s)", len(plan), gb, time.perf_counter() - t0, path)
        runs: dict[str, list[float]] = {"raw_1": [], "raw_n": [], "verify": [], "noverify": []}
        cpu: dict[str, list[float]] = {k: [] for k in runs}  # CPU seconds per GB (this process)
        jobs = {
            "raw_1": lambda: raw.read(),
            "raw_n": lambda: raw.read_threads(threads),
            "verify": lambda: _time_loader(path, plan, seq, threads, True),
            "noverify": lambda: _time_loader(path, plan, seq, threads, False),
        }
        raw.read()
        raw.read_threads(threads)  # its buffers, allocated and touched outside the timed passes
        _time_loader(path, plan, seq, threads, False)  # warm: page cache, pinned allocator, imports
        order = list(jobs)
        for r in range(repeats):
            for name in order[r % 4 :] + order[: r % 4]:  # rotate which goes first
                t, c = time.perf_counter(), _cpu_s()
                took = jobs[name]()
                took = took if isinstance(took, float) else time.perf_counter() - t
                runs[name].append(gb / took)
                cpu[name].append((_cpu_s() - c) / gb)
            log.info("repeat %d: %s", r, {k: round(v[-1], 2) for k, v in runs.items()})
        limit = [max(a, b) for a, b in zip(runs["raw_1"], runs["raw_n"], strict=True)]
        ratio = [v / lim for v, lim in zip(runs["verify"], limit, strict=True)]
        ratio_nv = [v / lim for v, lim in zip(runs["noverify"], limit, strict=True)]
        per_seq = seq * raw.row / 1e9 / statistics.median(runs["verify"])
        wait = overlap_wait_fraction(path, plan, seq, threads, 1.5 * per_seq)
        raw.close()
        store.close()
    return {
        "loader_gbps": round(statistics.median(runs["verify"]), 3),
        "loader_ratio": round(statistics.median(ratio), 3),
        "raw_gbps": round(statistics.median(limit), 3),
        "loader_gbps_noverify": round(statistics.median(runs["noverify"]), 3),
        "loader_ratio_noverify": round(statistics.median(ratio_nv), 3),
        "overlap_wait_fraction": round(wait, 4),
        "raw_gbps_1_thread": round(statistics.median(runs["raw_1"]), 3),
        "raw_gbps_threads": round(statistics.median(runs["raw_n"]), 3),
        "ratios": [round(x, 3) for x in ratio],
        # CPU per byte moves far less with the neighbours' load than the rates do: raw / loader is
        # the ratio both would reach on the same cores
        "cpu_s_per_gb": {k: round(statistics.median(v), 4) for k, v in cpu.items()},
        "cpu_ratio": round(statistics.median(cpu["raw_n"]) / statistics.median(cpu["verify"]), 3),
        "gb_per_pass": round(gb, 3),
        "threads": threads,
        "repeats": repeats,
        "pinned": torch.cuda.is_available(),
        "simulated_step_s": round(1.5 * per_seq, 4),
    }


def _cpu_s() -> float:
    """User + system CPU seconds of this process so far (every thread)."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="0.8 GB per pass, 3 repeats (~20 s on 2 cores)")
    ap.add_argument("--dir", default=None, help="where the store goes (default /dev/shm)")
    ap.add_argument(
        "--threads", type=int, default=2, help="loader read threads (and the raw multi-thread run)"
    )
    ap.add_argument("--repeats", type=int, default=None, help="interleaved repeats (default 5, quick 3)")
    ap.add_argument("--tokens", type=int, default=None, help="tokens in the store (default 96k, quick 24k)")
    ap.add_argument(
        "--store-url",
        help="also read from this object store (s3://bucket/prefix, or 'moto' "
        "to start the tests' server here) beside the local store; see scripts/bench_object_store.py",
    )
    ap.add_argument("--latency-ms", type=float, default=20.0, help="added per object-store request (proxy)")
    args = ap.parse_args()
    if args.store_url:
        import tempfile

        from bench_object_store import bench_object_store

        logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
        torch.set_num_threads(1)
        with tempfile.TemporaryDirectory(dir=args.dir or scratch_root(4e9)) as tmp:
            result = bench_object_store(args.store_url, quick=args.quick, latency_ms=args.latency_ms,
                                        tmp=Path(tmp), write_store=write_store,
                                        time_loader=lambda st, plan, seq, t: _time_loader(st, plan, seq, t, True))  # fmt: skip
        print(json.dumps(result))
        return
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s: %(message)s")
    torch.set_num_threads(1)
    result = bench_loader(quick=args.quick, directory=args.dir, threads=args.threads, repeats=args.repeats,
                          tokens=args.tokens)  # fmt: skip
    print(json.dumps(result))


if __name__ == "__main__":
    main()
