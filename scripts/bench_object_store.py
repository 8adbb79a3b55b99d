"""The loader from a store on object storage beside the same store on local disk, in one run.

``python scripts/bench_loader.py --store-url s3://bucket/prefix [--latency-ms 20] [--quick]``
(credentials and endpoint from the ``AWS_*`` variables), or ``--store-url moto`` to start the
tests' S3-compatible server (moto) here. A store is written locally, copied to the URL, then the
loader (``PackedLoader`` over ``StoreSource``, checksums checked) reads every sample from both,
interleaved and repeated, with ``read_threads`` = 1, 2, 4, ... reads in flight for the object
store. ``--latency-ms`` puts a proxy in front of the server that delays every request (a real
S3 round trip is 10-30 ms). Prints the GB/s of each and the fewest reads in flight that reach
0.8x the local rate (null when none does: the server, not the loader, is then the limit).
"""

from __future__ import annotations

import asyncio
import os
import statistics
import threading
from pathlib import Path


def _proxy(upstream: str, latency_s: float) -> str:
    """An HTTP proxy in a thread: every request waits ``latency_s``, then goes to ``upstream``."""
    import aiohttp
    from aiohttp import web

    box: dict = {}
    ready = threading.Event()

    async def handle(request: web.Request) -> web.StreamResponse:
        await asyncio.sleep(latency_s)
        body = await request.read()
        headers = {k: v for k, v in request.headers.items() if k.lower() not in ("host", "content-length")}
        async with box["session"].request(
            request.method, upstream + request.path_qs, data=body, headers=headers, allow_redirects=False
        ) as r:
            data = await r.read()
            head = request.method == "HEAD"  # keeps the server's Content-Length, has no body
            drop = ("transfer-encoding",) if head else ("content-length", "transfer-encoding")
            out = {k: v for k, v in r.headers.items() if k.lower() not in drop}
            return web.Response(status=r.status, body=None if head else data, headers=out)

    def run() -> None:
        loop = asyncio.new_event_loop()

        async def start() -> None:
            box["session"] = aiohttp.ClientSession(auto_decompress=False)
            app = web.Application(client_max_size=1 << 30)
            app.router.add_route("*", "/{tail:.*}", handle)
            runner = web.AppRunner(app, access_log=None)
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            box["url"] = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"

        loop.run_until_complete(start())
        ready.set()
        loop.run_forever()

    threading.Thread(target=run, daemon=True).start()
    ready.wait(30)
    return box["url"]


def _moto() -> str:
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    url = f"http://{host}:{port}"
    os.environ.update(
        {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench", "AWS_DEFAULT_REGION": "us-east-1"}
    )
    import boto3

    boto3.client("s3", endpoint_url=url).create_bucket(Bucket="hsgen-bench")
    return url


def bench_object_store(
    url: str, *, quick: bool, latency_ms: float, tmp: Path, write_store, time_loader
) -> dict:
    """Loader GB/s local vs object store; ``write_store(path, tokens)`` builds the local store,
    ``time_loader(store, plan, seq, threads)`` is one checked pass of the loader, in seconds."""
    from hsgen.store import HiddenStateStore
    from spectrain.data import StoreSource

    upstream = None
    if url == "moto":
        upstream = _moto()
        url = "s3://hsgen-bench/store"
    else:
        upstream = os.environ.get("AWS_ENDPOINT_URL")
    if latency_ms and upstream:
        os.environ["AWS_ENDPOINT_URL"] = _proxy(upstream, latency_ms / 1000)
    elif upstream:
        os.environ["AWS_ENDPOINT_URL"] = upstream
    tokens = 8192 if quick else 32768
    local = tmp / "local-store"
    write_store(local, tokens)
    src = HiddenStateStore.open(local)
    dst = HiddenStateStore.create(url, src.header)
    with dst.writer(shard_bytes=32 << 20) as w:
        for s in src:
            w.add(s.sample_id, s.hidden_states, s.token_ids, s.loss_mask)
    plan = StoreSource(local, val_fraction=0.0).plan(0)
    seq = 8192
    ladder = [1, 4, 16] if quick else [1, 2, 4, 8, 16, 32]
    repeats = 2 if quick else 3
    nbytes = src.stats()["bytes"]
    local_rates: list[float] = []
    remote: dict[int, list[float]] = {t: [] for t in ladder}
    for _ in range(repeats):
        local_rates.append(nbytes / time_loader(local, plan, seq, 2) / 1e9)
        for t in ladder:
            remote[t].append(nbytes / time_loader(url, plan, seq, t) / 1e9)
    local_gbps = statistics.median(local_rates)
    rates = {t: statistics.median(v) for t, v in remote.items()}
    enough = next((t for t in ladder if rates[t] >= 0.8 * local_gbps), None)
    return {
        "object_store_url": url,
        "added_latency_ms": latency_ms,
        "tokens": tokens,
        "bytes": nbytes,
        "local_loader_gbps": round(local_gbps, 4),
        "object_store_loader_gbps": {str(t): round(r, 4) for t, r in rates.items()},
        "object_store_ratio": {str(t): round(r / local_gbps, 4) for t, r in rates.items()},
        "reads_in_flight_for_0.8x": enough,
    }
