#!/usr/bin/env python3
"""Benchmark the hidden-state store against raw numpy I/O of the same bytes, in the same run.

Samples are realistic: 128-8192 tokens (log-uniform), 4 layers x 4096 hidden, bf16 (stored as
uint16). For each location (/dev/shm and a disk directory) the script times

- store write: ``ShardWriter.add`` for every sample, shards committed with fsync, manifest fsynced;
- raw write:   the same samples grouped into the same shard-sized files, ``ndarray.tofile`` for
               hidden states, token ids and loss mask of each sample, then ``os.fsync``;
- store read:  ``HiddenStateStore.read`` of every sample in a shuffled order;
- raw read:    ``np.fromfile(offset=..., count=...)`` of the same three arrays per sample.

Before each disk read pass the files are dropped from the page cache (``posix_fadvise``
DONTNEED), so disk reads come from the device. Each figure is the median of ``--repeats`` runs
(the shared VM is noisy; the median is steadier than the best run).
Progress goes to stderr; the last stdout line is one JSON object with the keys
``write_ratio_shm, read_ratio_shm, write_ratio_disk, read_ratio_disk, write_gbps_shm, read_gbps_shm``
(ratio = store throughput / raw throughput; gbps = 1e9 bytes/s of hidden states + ids + mask).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

import ml_dtypes
import numpy as np

from hsgen.store import HiddenStateStore, StoreHeader
from hsgen.store.codecs import checksum

log = logging.getLogger("bench_store")

LAYERS, HIDDEN = 4, 4096


def make_samples(total_bytes: int, seed: int, min_tokens: int, max_tokens: int):
    """Sample arrays totalling about ``total_bytes`` of hidden states.

    Hidden states are views of one pool of normally distributed bf16 values (stored as uint16).
    """
    rng = np.random.default_rng(seed)
    row = LAYERS * HIDDEN
    lengths = []
    while sum(lengths) * row * 2 < total_bytes:
        lengths.append(int(np.exp(rng.uniform(np.log(min_tokens), np.log(max_tokens + 1)))))
    pool_rows = max(lengths) + 4096
    pool = np.empty((pool_rows, LAYERS, HIDDEN), dtype=np.uint16)
    for lo in range(0, pool_rows, 1024):
        block = rng.standard_normal((min(1024, pool_rows - lo), LAYERS, HIDDEN), dtype=np.float32)
        pool[lo : lo + len(block)] = block.astype(ml_dtypes.bfloat16).view(np.uint16)
    samples = []
    for i, n in enumerate(lengths):
        start = int(rng.integers(0, pool_rows - n))
        ids = rng.integers(0, 150_000, n, dtype=np.int64)
        mask = (rng.random(n) < 0.7).astype(np.uint8)
        samples.append((f"s{i:05d}", pool[start : start + n], ids, mask))
    return samples


def nbytes(samples) -> int:
    return sum(h.nbytes + t.nbytes + m.nbytes for _, h, t, m in samples)


def groups_like_writer(samples, shard_bytes: int):
    """Group samples exactly as ShardWriter does (flush before overflowing, and once full)."""
    groups, cur, size = [], [], 0
    for s in samples:
        if cur and size + s[1].nbytes > shard_bytes:
            groups.append(cur)
            cur, size = [], 0
        cur.append(s)
        size += s[1].nbytes
        if size >= shard_bytes:
            groups.append(cur)
            cur, size = [], 0
    if cur:
        groups.append(cur)
    return groups


def drop_cache(root: Path) -> None:
    """Evict the files under ``root`` from the page cache (they are clean after fsync)."""
    for dirpath, _dirs, files in os.walk(root):
        for f in files:
            fd = os.open(os.path.join(dirpath, f), os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def raw_write(root: Path, groups) -> dict:
    """Write each group to one file with ndarray.tofile + fsync; returns sample -> (file, offsets)."""
    root.mkdir(parents=True)
    where = {}
    for k, group in enumerate(groups):
        path = root / f"{k:06d}.bin"
        with open(path, "wb") as f:
            pos = 0
            for sid, h, t, m in group:
                h.tofile(f)
                t.tofile(f)
                m.tofile(f)
                where[sid] = (path, pos, len(t))
                pos += h.nbytes + t.nbytes + m.nbytes
            f.flush()
            os.fsync(f.fileno())
    fd = os.open(root, os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)
    return where


def raw_read(where: dict, order) -> int:
    total = 0
    row = LAYERS * HIDDEN
    for sid in order:
        path, pos, n = where[sid]
        h = np.fromfile(path, dtype=np.uint16, count=n * row, offset=pos).reshape(n, LAYERS, HIDDEN)
        t = np.fromfile(path, dtype=np.int64, count=n, offset=pos + h.nbytes)
        m = np.fromfile(path, dtype=np.uint8, count=n, offset=pos + h.nbytes + t.nbytes)
        total += h.nbytes + t.nbytes + m.nbytes
    return total


def store_write(root: Path, samples, shard_bytes: int, codec: str = "raw") -> None:
    header = StoreHeader("bench", tuple(range(LAYERS)), HIDDEN, "bfloat16", codec=codec)
    store = HiddenStateStore.create(root, header)
    with store.writer("bench", shard_bytes=shard_bytes) as w:
        for sid, h, t, m in samples:
            w.add(sid, h, t, m)
    store.close()


def store_read(root: Path, order) -> int:
    total = 0
    with HiddenStateStore.open(root) as store:
        for sid in order:
            s = store.read(sid)
            total += s.hidden_states.nbytes + s.token_ids.nbytes + s.loss_mask.nbytes
    return total


def timed(fn, *args) -> float:
    t0 = time.perf_counter()
    fn(*args)
    return time.perf_counter() - t0


def run_location(base: Path, samples, shard_bytes: int, repeats: int, disk: bool) -> dict:
    """Median over ``repeats`` runs of write and read throughput (GB/s) of store and raw under ``base``.

    Passes alternate between raw and store. Before each write pass ``os.sync()`` settles earlier
    dirty data; on disk the outputs are deleted only at the end (deleting triggers discards that
    would slow the next pass).
    """
    size = nbytes(samples)
    groups = groups_like_writer(samples, shard_bytes)
    order = [s[0] for s in samples]
    random.Random(0).shuffle(order)
    runs: dict[str, list[float]] = {"store_write": [], "raw_write": [], "store_read": [], "raw_read": []}
    for rep in range(repeats):
        for kind in ("raw", "store") if rep % 2 == 0 else ("store", "raw"):
            root = base / f"{kind}-{rep}"
            os.sync()
            if kind == "raw":
                holder = {}
                dt = timed(lambda: holder.update(where=raw_write(root, groups)))  # noqa: B023
            else:
                dt = timed(store_write, root, samples, shard_bytes)
            w = size / dt / 1e9
            if disk:
                drop_cache(root)
            if kind == "raw":
                dt = timed(raw_read, holder["where"], order)
            else:
                dt = timed(store_read, root, order)
            r = size / dt / 1e9
            runs[f"{kind}_write"].append(w)
            runs[f"{kind}_read"].append(r)
            if not disk:
                shutil.rmtree(root)
            log.info("  %-5s rep %d: write %.2f GB/s, read %.2f GB/s", kind, rep, w, r)
    return {k: float(np.median(v)) for k, v in runs.items()}


def checksum_gbps(samples, algorithm: str) -> float:
    """One-core throughput of a store checksum algorithm on the largest sample (best of 3)."""
    h = max(samples, key=lambda s: s[1].nbytes)[1]
    best = 0.0
    for _ in range(3):
        t0 = time.perf_counter()
        checksum([h], algorithm)
        best = max(best, h.nbytes / (time.perf_counter() - t0) / 1e9)
    return best


def sweep(base: Path, samples, repeats: int) -> None:
    """Store write/read GB/s on ``base`` for shard sizes 8-64 MiB and the three codecs (stderr)."""
    order = [s[0] for s in samples]
    random.Random(1).shuffle(order)
    size = nbytes(samples)
    log.info("sweep on %s (%.2f GB):", base, size / 1e9)
    for codec, mib in [("raw", 8), ("raw", 16), ("raw", 32), ("raw", 64), ("lz4", 32), ("fp8", 32)]:
        w = r = 0.0
        for rep in range(repeats):
            root = base / f"sweep-{codec}-{mib}-{rep}"
            w = max(w, size / timed(store_write, root, samples, mib << 20, codec) / 1e9)
            r = max(r, size / timed(store_read, root, order) / 1e9)
            stored = HiddenStateStore.open(root).stats()["bytes_per_token"]
            shutil.rmtree(root)
        log.info(
            "  codec %-4s shard %2d MiB: write %.2f GB/s, read %.2f GB/s, %.0f bytes/token",
            codec,
            mib,
            w,
            r,
            stored,
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--quick",
        action="store_true",
        help="0.4 GB of samples up to 2048 tokens, median of 3 (under a minute)",
    )
    ap.add_argument(
        "--gb", type=float, default=None, help="sample bytes per pass, in GB (default 1.0; quick 0.4)"
    )
    ap.add_argument(
        "--repeats", type=int, default=None, help="runs per figure, median kept (default 4; quick 3)"
    )
    ap.add_argument("--shard-mib", type=int, default=32, help="store shard size in MiB (default 32)")
    ap.add_argument("--shm-dir", default="/dev/shm", help="RAM-backed directory (default /dev/shm)")
    ap.add_argument("--disk-dir", default=None, help="disk-backed directory (default: the system temp dir)")
    ap.add_argument(
        "--sweep", action="store_true", help="also time shard sizes 8-64 MiB and codecs on shm (stderr)"
    )
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    gb = args.gb if args.gb is not None else (0.4 if args.quick else 1.0)
    repeats = args.repeats if args.repeats is not None else (3 if args.quick else 4)
    max_tokens = 2048 if args.quick else 8192
    samples = make_samples(int(gb * 1e9), args.seed, 128, max_tokens)
    log.info(
        "%d samples, %d-%d tokens, %.2f GB per pass, shard %d MiB, median of %d",
        len(samples),
        min(len(s[2]) for s in samples),
        max(len(s[2]) for s in samples),
        nbytes(samples) / 1e9,
        args.shard_mib,
        repeats,
    )
    log.info(
        "checksums on one core: bsum64 %.2f GB/s, crc32 %.2f GB/s",
        checksum_gbps(samples, "bsum64"),
        checksum_gbps(samples, "crc32"),
    )
    results = {}
    for name, parent, disk in [("shm", args.shm_dir, False), ("disk", args.disk_dir, True)]:
        base = Path(tempfile.mkdtemp(prefix="hsgen-bench-", dir=parent))
        try:
            log.info("%s: %s", name, base)
            results[name] = run_location(base, samples, args.shard_mib << 20, repeats, disk)
            if args.sweep and name == "shm":
                sweep(base, samples, repeats)
        finally:
            shutil.rmtree(base, ignore_errors=True)
    shm, dsk = results["shm"], results["disk"]
    out = {
        "write_ratio_shm": round(shm["store_write"] / shm["raw_write"], 3),
        "read_ratio_shm": round(shm["store_read"] / shm["raw_read"], 3),
        "write_ratio_disk": round(dsk["store_write"] / dsk["raw_write"], 3),
        "read_ratio_disk": round(dsk["store_read"] / dsk["raw_read"], 3),
        "write_gbps_shm": round(shm["store_write"], 3),
        "read_gbps_shm": round(shm["store_read"], 3),
    }
    log.info(
        "raw: shm write %.2f read %.2f GB/s; disk write %.2f read %.2f GB/s",
        shm["raw_write"],
        shm["raw_read"],
        dsk["raw_write"],
        dsk["raw_read"],
    )
    log.info("store: disk write %.2f read %.2f GB/s", dsk["store_write"], dsk["store_read"])
    print(json.dumps(out))


if __name__ == "__main__":
    main()
