#!/usr/bin/env python
"""Benchmark ``hsgen generate``: saturation of capacity-limited servers, and ingest overhead.

1. Saturation: the reference server (``hsgen serve``, own process) runs with a capacity model
   of C concurrent sequences per step for several C. Prompts have a fixed length, so the
   capacity is exactly ``C / step_seconds(C * len)`` sequences per second. hsgen with default
   settings, then a fixed-concurrency client (``--concurrency 8``), run against it; the
   steady-state rate is read from the server's ``vllm:request_success_total`` counter.
2. Ingest: a server whose files are ready at once (pre-written safetensors files in
   /dev/shm) is drained into a store on disk; hidden-state bytes landed per second are
   compared with a raw copy of the same bytes from /dev/shm to the same disk (fsync'd) and with
   a direct copy (``O_DIRECT`` through two reused 4 MiB buffers, fsync'd: the disk's own pace,
   which no page cache slows), the three interleaved (which goes first rotates per rep). Every
   rep is reported with the load average, the first-touch speed of new memory after it (the
   VM's state: see ``docs/benchmarks.md``) and hsgen's seconds per phase; ``ingest_ratio`` is
   the median of the paired per-rep ratios against the raw copy, ``ingest_ratio_direct`` against
   the direct copy.

Progress goes to stderr; the last stdout line is JSON with ``saturation_min`` (over the
capacities, the smallest share of the server's step capacity hsgen's default kept in use: busy
share x batch fill, from the server's own counters), ``throughput_min`` (its completions over
the capacity model's rate, which also counts steps the shared CPU slowed), ``ingest_ratio``,
``ingest_ratio_direct`` and ``ingest_gbps``. A run that stored nothing, failed a sample or ended on a
fatal error measured nothing: the script says why on stderr and exits 1, printing no figure.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
import uuid
from pathlib import Path

import numpy as np

from hsgen.client.config import ClientConfig
from hsgen.client.saturate import SaturationConfig
from hsgen.generate.pipeline import GenerateConfig, generate
from hsgen.inputs.render import RenderedPrompt
from hsgen.protocol import extraction as protocol
from hsgen.store import HiddenStateStore, StoreHeader


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


class NotMeasured(Exception):
    """A part of the benchmark did not run as it must: no figure of it may be printed."""


def check_ran(summary, what: str, expect_all: int | None = None) -> None:
    """Raise :class:`NotMeasured` unless the generate run stored samples and lost none."""
    if summary.fatal or summary.stored == 0 or summary.failed:
        raise NotMeasured(
            f"{what}: {summary.stored} stored, {summary.failed} failed, fatal: {summary.fatal} "
            f"(failures: {summary.failure_reasons})"
        )
    if expect_all is not None and summary.stored != expect_all:
        raise NotMeasured(f"{what}: {summary.stored} of {expect_all} samples stored")


COUNTERS = ("vllm:request_success_total", "hsgen:engine_steps_total", "hsgen:engine_busy_seconds_total")


def served_count(url: str) -> tuple[float, ...]:
    """The server's completed requests, forward steps and seconds spent in steps so far."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        m = protocol.parse_prometheus(r.read().decode())
    return tuple(m.get(k, 0.0) for k in COUNTERS)


async def completion_rate(url: str, start: float, end: float, poll_s: float = 0.05) -> dict[str, float]:
    """The server's completions per second between ``start`` and ``end`` (monotonic times), with
    its steps per second and the share of that time it spent in steps.

    A batching server finishes a whole step's sequences at once, so its counter moves in
    bursts of up to C; counting from fixed instants would be off by up to one step (10% of a
    4.5 s window at C = 64). The rate is taken between the first and the last burst seen in
    the window instead: whole steps over the time they took (``poll_s`` of error at each end).
    """
    await asyncio.sleep(max(0.0, start - time.monotonic()))
    first = last = None
    prev = await asyncio.to_thread(served_count, url)
    while time.monotonic() < end:
        await asyncio.sleep(poll_s)
        now, t = await asyncio.to_thread(served_count, url), time.monotonic()
        if now[0] != prev[0]:
            first = first or (t, now)
            last = (t, now)
        prev = now
    if first is None or last is None or last[0] <= first[0]:
        raise NotMeasured(f"the server at {url} finished fewer than two steps in the measured window")
    dt = last[0] - first[0]
    done, steps, busy = (b - a for a, b in zip(first[1], last[1], strict=True))
    return {"rate": done / dt, "steps_per_s": steps / dt, "busy": busy / dt}


async def run_client(url, shared, prompts, store, concurrency, seconds, measure_after):
    """Run generate for ``seconds``; return the server's completion rate after ``measure_after``."""
    stop = asyncio.Event()
    cfg = GenerateConfig(
        client=ClientConfig([url], shared_dir=str(shared)),
        saturation=SaturationConfig(concurrency=concurrency),
        shard_bytes=64 << 20,
        stop_grace_s=60,
    )
    task = asyncio.create_task(generate(cfg, prompts, store, progress=False, stop=stop))
    t0 = time.monotonic()
    try:
        got = await completion_rate(url, t0 + measure_after, t0 + seconds)
    finally:
        stop.set()
        summary = await task
    check_ran(summary, f"saturation against {url}")
    limit = summary.endpoints.get(url, {}).get("limit")
    return got, limit


def bench_saturation(capacities, ideal_rate, prompt_len, quick, workdir: Path) -> list[dict]:
    from hsgen.serve.capacity import CapacityModel
    from hsgen.serve.testing import running_server

    rng = random.Random(0)
    results = []
    for cap in capacities:
        rate = 1e6
        step = cap / ideal_rate
        model = CapacityModel(
            prefill_tokens_per_s=rate,
            max_concurrent_seqs=cap,
            step_overhead_s=step - cap * prompt_len / rate,
        )
        capacity = cap / model.step_seconds(cap * prompt_len)
        seconds = max(10.0, 14 * step) if quick else max(20.0, 30 * step)
        measure_after = seconds * 0.55
        n = int(capacity * seconds * 3) + 4 * cap
        shared = Path("/dev/shm") / f"hsgen-bench-{uuid.uuid4().hex[:8]}"
        row = {"capacity_seqs": cap, "capacity_per_s": round(capacity, 1), "seconds": round(seconds, 1)}
        with running_server(
            "tiny",
            [1, 2, 4],
            shared,
            dtype="float32",  # the store's: --dtype auto would send the model's bf16
            capacity=model,
            mode="process",
            max_num_seqs=max(256, cap),
            max_num_batched_tokens=max(8192, 4 * cap * prompt_len),
        ) as url:
            # the fixed client is the reference for the machine's ceiling; --quick runs it at the
            # smallest C only (at larger C it reads about 8/C, and costs a quarter of the run)
            clients = [("hsgen_default", None)]
            if not quick or cap == capacities[0]:
                clients.append(("fixed_8", 8))
            for name, conc in clients:
                prompts = [
                    RenderedPrompt(
                        f"{name}-{cap}-{i}",
                        [rng.randrange(1, 1000) for _ in range(prompt_len)],
                        [1] * prompt_len,
                    )
                    for i in range(n)
                ]
                store_path = workdir / f"sat-{cap}-{name}"
                store = HiddenStateStore.create(store_path, StoreHeader("tiny", (1, 2, 4), 64, "float32"))
                got, limit = asyncio.run(
                    run_client(url, shared, prompts, store, conc, seconds, measure_after)
                )
                # saturation = busy share x (nominal step / mean step) x batch fill: idle time is
                # the client's doing, longer steps the server process's (CPU), part-empty steps both
                steps = got["steps_per_s"]
                parts = {
                    "busy": got["busy"],
                    "step_speed": step * steps / got["busy"] if got["busy"] else 0.0,
                    "fill": got["rate"] / steps / cap if steps else 0.0,
                }
                row[name] = round(got["rate"] / capacity, 3)
                row[f"{name}_limit"] = limit
                row.update({f"{name}_{k}": round(v, 3) for k, v in parts.items()})
                # the share of the server's step capacity the client kept in use (its policy's part)
                row[f"{name}_utilisation"] = round(parts["busy"] * parts["fill"], 3)
                shutil.rmtree(store_path, ignore_errors=True)
                log(
                    f"capacity {cap:4d} seqs ({capacity:.0f}/s): {name} reached {got['rate']:.1f}/s = "
                    f"{got['rate'] / capacity:.1%} (limit {limit}; server busy {parts['busy']:.1%}, "
                    f"steps at {parts['step_speed']:.1%} of the model's speed, {parts['fill']:.1%} full: "
                    f"utilisation {parts['busy'] * parts['fill']:.1%})"
                )
        shutil.rmtree(shared, ignore_errors=True)
        results.append(row)
    return results


# ----------------------------------------------------------------------------- ingest


def make_file(path: Path, tokens: int, layers: int, hidden: int, seed: int) -> list[int]:
    rng = np.random.default_rng(seed)
    ids = rng.integers(1, 30000, size=tokens, dtype=np.int64)
    states = rng.standard_normal((tokens, layers, hidden), dtype=np.float32).astype(np.float16)
    header, _ = protocol.safetensors_header_bytes(
        [("hidden_states", "float16", states.shape), ("token_ids", "int64", ids.shape)]
    )
    with open(path, "wb") as f:
        f.write(header)
        f.write(states.tobytes())
        f.write(ids.tobytes())
    return ids.tolist()


class ReadyServer:
    """Answers each completion with the next pre-written file (files ready at once)."""

    def __init__(self, files: dict[tuple[int, ...], str]):
        self.files = files

    def start(self) -> str:
        from aiohttp import web

        async def models(request):
            return web.json_response({"data": [{"id": "ready"}]})

        async def completions(request):
            body = await request.json()
            ids = body["prompt"]
            path = self.files[tuple(ids[:4])]
            return web.json_response(
                {
                    "id": "cmpl-x",
                    "choices": [{"index": 0, "text": "", "prompt_token_ids": ids, "token_ids": [1]}],
                    "kv_transfer_params": {"hidden_states_path": path},
                }
            )

        app = web.Application(client_max_size=1 << 28)
        app.router.add_get("/v1/models", models)
        app.router.add_post("/v1/completions", completions)
        self.loop = asyncio.new_event_loop()
        ready = threading.Event()
        box = {}

        def run():
            asyncio.set_event_loop(self.loop)
            runner = web.AppRunner(app, access_log=None)
            self.loop.run_until_complete(runner.setup())
            site = web.TCPSite(runner, "127.0.0.1", 0)
            self.loop.run_until_complete(site.start())
            box["url"] = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
            box["runner"] = runner
            ready.set()
            self.loop.run_forever()
            self.loop.run_until_complete(runner.cleanup())

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()
        ready.wait(30)
        return box["url"]

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(30)


def prepare_files(shared: Path, n: int, tokens: int, layers: int, hidden: int):
    shared.mkdir(parents=True, exist_ok=True)
    files, prompts = {}, []
    for i in range(n):
        path = shared / f"cmpl-{i:05d}.safetensors"
        ids = make_file(path, tokens, layers, hidden, seed=i)
        ids[0] = i + 1  # unique prefix -> file
        arr = np.asarray(ids, dtype=np.int64)
        with open(path, "r+b") as f:  # rewrite the token ids with the unique first id
            t = protocol.read_safetensors_header(f)["token_ids"]
            f.seek(t.start)
            f.write(arr.tobytes())
        files[tuple(ids[:4])] = str(path)
        prompts.append(RenderedPrompt(f"s{i}", ids, [1] * tokens))
    return files, prompts


def raw_copy(shared: Path, dest: Path) -> tuple[int, float]:
    dest.mkdir(parents=True, exist_ok=True)
    total = 0
    t0 = time.perf_counter()
    for p in sorted(shared.iterdir()):
        out = dest / p.name
        shutil.copyfile(p, out)
        with open(out, "rb") as f:
            os.fsync(f.fileno())
        total += p.stat().st_size
    fd = os.open(dest, os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)
    return total, time.perf_counter() - t0


def direct_copy(shared: Path, dest: Path, block: int = 4 << 20) -> tuple[int, float]:
    """The same bytes copied with ``O_DIRECT`` through two reused page-aligned buffers, one read
    while the other is written on a thread (the tail past the last block written as usual), each
    file fsync'd, then the directory: what the disk takes when no page cache is filled."""
    import mmap
    from concurrent.futures import ThreadPoolExecutor

    from hsgen.store.fsutil import pwrite_all

    dest.mkdir(parents=True, exist_ok=True)
    bufs = [mmap.mmap(-1, block) for _ in range(2)]
    total = 0
    t0 = time.perf_counter()
    with ThreadPoolExecutor(1) as io:
        for p in sorted(shared.iterdir()):
            out = dest / p.name
            fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            dfd = os.open(out, os.O_WRONLY | getattr(os, "O_DIRECT", 0))
            pending, cur, offset = None, 0, 0
            with open(p, "rb", buffering=0) as f:
                while True:
                    n = f.readinto(bufs[cur])
                    if pending is not None:
                        pending.result()
                    if n < block:
                        if n:
                            pwrite_all(fd, memoryview(bufs[cur])[:n], offset)
                        offset += n
                        break
                    pending = io.submit(pwrite_all, dfd, memoryview(bufs[cur]), offset)
                    offset += n
                    cur ^= 1
            os.fsync(fd)
            os.close(dfd)
            os.close(fd)
            total += offset
    fd = os.open(dest, os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)
    dt = time.perf_counter() - t0
    for b in bufs:
        b.close()
    return total, dt


def hsgen_ingest(
    url: str, shared: Path, dest: Path, prompts, hidden: int, codec: str = "raw"
) -> tuple[float, dict]:
    """Seconds for ``generate`` to land every prompt's ready file in a fresh store at ``dest``, and
    the run's seconds per phase (summed over threads; ``queue`` sums every sample's wait)."""
    store = HiddenStateStore.create(dest, StoreHeader("ready", (1, 2, 3, 4), hidden, "float16", codec=codec))
    cfg = GenerateConfig(
        client=ClientConfig([url], shared_dir=str(shared), delete_files=False), shard_bytes=256 << 20
    )
    t0 = time.perf_counter()
    summary = asyncio.run(generate(cfg, prompts, store, progress=False))
    dt = time.perf_counter() - t0
    check_ran(summary, "ingest", expect_all=len(prompts))
    return dt, summary.phases


def fresh_touch_gbps(nbytes: int = 256 << 20) -> float:
    """GB/s of a first touch of ``nbytes`` of new memory: the machine's state, not hsgen's. On a VM
    that returns freed memory to its host (free page reporting) this swings 5-20x with what the
    host has reclaimed, and so does anything that fills new page cache, a raw copy included."""
    import mmap

    m = mmap.mmap(-1, nbytes)
    t0 = time.perf_counter()
    np.frombuffer(m, dtype=np.uint8)[:: mmap.PAGESIZE] = 1
    dt = time.perf_counter() - t0
    m.close()
    return nbytes / dt / 1e9


def _spread(xs: list[float]) -> dict:
    return {"reps": [round(x, 3) for x in xs], "median": round(statistics.median(xs), 3),
            "min": round(min(xs), 3), "max": round(max(xs), 3), "spread": round(max(xs) / min(xs), 2)}  # fmt: skip


def bench_ingest(workdir: Path, quick: bool, reps: int = 5, codec: str = "raw") -> dict:
    """Raw copy and hsgen ingest of the same files, interleaved ``reps`` times (which goes first
    alternates); every rep, the paired ratio, the spread, the load and the phases are reported."""
    tokens, layers, hidden = 2048, 4, 1024  # 16 MiB of float16 hidden states per sample
    n = 32 if quick else 160
    shared = Path("/dev/shm") / f"hsgen-ingest-{uuid.uuid4().hex[:8]}"
    server = None
    try:
        log(f"ingest: writing {n} files of {tokens * layers * hidden * 2 / 2**20:.0f} MiB to {shared}")
        files, prompts = prepare_files(shared, n, tokens, layers, hidden)
        hs_bytes = n * tokens * layers * hidden * 2
        server = ReadyServer(files)
        url = server.start()
        raw_rates, direct_rates, hsgen_rates, loads, touch, phases = [], [], [], [], [], []
        legs = ("raw", "direct", "hsgen")
        for rep in range(reps):
            load = os.getloadavg()[0]
            order = legs[rep % 3 :] + legs[: rep % 3]
            for which in order:
                if which in ("raw", "direct"):
                    copy = raw_copy if which == "raw" else direct_copy
                    total, dt = copy(shared, workdir / "copy")
                    shutil.rmtree(workdir / "copy")
                    (raw_rates if which == "raw" else direct_rates).append(total / dt / 1e9)
                else:
                    dt, ph = hsgen_ingest(url, shared, workdir / "ingest", prompts, hidden, codec)
                    shutil.rmtree(workdir / "ingest")
                    hsgen_rates.append(hs_bytes / dt / 1e9)
                    phases.append({"wall": round(dt, 3), **ph})
            loads.append(round((load + os.getloadavg()[0]) / 2, 2))
            touch.append(fresh_touch_gbps())
            log(
                f"ingest rep {rep} ({' then '.join(order)}): raw copy {raw_rates[-1]:.3f} GB/s, direct copy "
                f"{direct_rates[-1]:.3f} GB/s, hsgen landed {hsgen_rates[-1]:.3f} GB/s (ratios "
                f"{hsgen_rates[-1] / raw_rates[-1]:.2f} / {hsgen_rates[-1] / direct_rates[-1]:.2f}), load {loads[-1]}, "
                f"fresh memory {touch[-1]:.2f} GB/s; phases {json.dumps(phases[-1])}"
            )
        ratios = [h / r for h, r in zip(hsgen_rates, raw_rates, strict=True)]
        direct = [h / r for h, r in zip(hsgen_rates, direct_rates, strict=True)]
        raw_gbps, gbps = statistics.median(raw_rates), statistics.median(hsgen_rates)
        log(f"ingest: median raw copy /dev/shm -> disk {raw_gbps:.3f} GB/s, direct copy "
            f"{statistics.median(direct_rates):.3f} GB/s, hsgen {gbps:.3f} GB/s, paired ratio median "
            f"{statistics.median(ratios):.2f} (min {min(ratios):.2f}) against the raw copy, "
            f"{statistics.median(direct):.2f} (min {min(direct):.2f}) against the direct copy")  # fmt: skip
        return {
            "ingest_gbps": round(gbps, 3),
            "raw_copy_gbps": round(raw_gbps, 3),
            "ingest_ratio": round(statistics.median(ratios), 3),
            "ingest_ratio_direct": round(statistics.median(direct), 3),
            "ingest": {
                "hsgen_gbps": _spread(hsgen_rates),
                "raw_copy_gbps": _spread(raw_rates),
                "direct_copy_gbps": _spread(direct_rates),
                "paired_ratio": _spread(ratios),
                "paired_ratio_direct": _spread(direct),
                "load": loads,
                "fresh_memory_touch_gbps": [round(x, 2) for x in touch],
                "phases_s": phases,
            },
        }
    finally:
        if server is not None:
            server.stop()
        shutil.rmtree(shared, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--quick",
        action="store_true",
        help="short runs (about a minute on 2 cores): capacities 4 and 64 (the fixed client at 4 only), "
        "32 ingest files",
    )
    ap.add_argument("--capacities", default=None, help="comma-separated concurrent-sequence capacities")
    ap.add_argument("--rate", type=float, default=150.0, help="server capacity in sequences per second")
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--skip-saturation", action="store_true")
    ap.add_argument("--skip-ingest", action="store_true")
    ap.add_argument("--codec", default="raw", choices=["raw", "fp8", "lz4"],
                    help="the ingest store's codec (default raw; fp8 adds the 'encode' phase, lz4 compresses at the seal)")  # fmt: skip
    ap.add_argument(
        "--workdir", default=None, help="disk directory for stores (default: a temp dir under /tmp)"
    )
    args = ap.parse_args()
    caps = (
        [int(x) for x in args.capacities.split(",")]
        if args.capacities
        else ([4, 64] if args.quick else [4, 16, 64, 256])
    )
    workdir = Path(tempfile.mkdtemp(prefix="hsgen-bench-", dir=args.workdir or "/tmp"))
    out: dict = {}
    try:
        if not args.skip_saturation:
            rows = bench_saturation(caps, args.rate, args.prompt_len, args.quick, workdir)
            out["saturation"] = rows
            out["saturation_min"] = min(r["hsgen_default_utilisation"] for r in rows)
            out["throughput_min"] = min(r["hsgen_default"] for r in rows)
        if not args.skip_ingest:
            out.update(bench_ingest(workdir, args.quick, reps=5 if args.quick else 9, codec=args.codec))
    except NotMeasured as e:
        log(f"bench_generate: not measured: {e}")
        sys.exit(1)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    final = {
        k: out[k]
        for k in ("saturation_min", "throughput_min", "ingest_ratio", "ingest_ratio_direct", "ingest_gbps")
        if k in out
    }
    log(json.dumps(out))
    print(json.dumps(final))


if __name__ == "__main__":
    main()
