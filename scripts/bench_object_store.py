"""The loader from a store on object storage beside the same store on local disk, in one run.

``python scripts/bench_loader.py --store-url s3://bucket/prefix [--latency-ms 20] [--quick]``
(credentials and endpoint from the ``AWS_*`` variables), ``--store-url s3rver`` to start s3rver
(Node, ``npm install s3rver@3.7.1``; found on ``PATH`` or through ``$S3RVER``) or ``--store-url
moto`` to start the tests' server (moto), each in its own process. A store is written locally,
copied to the URL, then the loader (``PackedLoader`` over ``StoreSource``, checksums checked)
reads every sample from the local store, from the server directly and through a proxy that
delays every request by ``--latency-ms`` (a real S3 round trip is 10-30 ms; the proxy runs in its
own process too), interleaved and repeated, with 1, 4, 16, ... reads in flight. Prints the GB/s of
each, the ratios to the local rate and to the direct one (how much of the latency the reads in
flight hide), and the fewest reads in flight that reach 0.8x of each (null when none does).
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import os
import re
import shutil
import statistics
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

_BUCKET = "hsgen-bench"


def _serve_proxy(upstream: str, latency_s: float, conn) -> None:
    """An HTTP proxy (a process of its own): every request waits ``latency_s``, then goes to ``upstream``."""
    from aiohttp import ClientSession, web

    box: dict = {}

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

    async def start() -> None:
        box["session"] = ClientSession(auto_decompress=False)
        app = web.Application(client_max_size=1 << 30)
        app.router.add_route("*", "/{tail:.*}", handle)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        conn.send(f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}")

    loop = asyncio.new_event_loop()
    loop.run_until_complete(start())
    loop.run_forever()


def _serve_moto(conn) -> None:
    """moto's S3 server (a process of its own)."""
    import threading

    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    conn.send(f"http://{host}:{port}")
    threading.Event().wait()


@contextlib.contextmanager
def _process(target, *args) -> Iterator[str]:
    """Run ``target(*args, conn)`` in a spawned process; yields the URL it sends, stops it after."""
    ctx = multiprocessing.get_context("spawn")
    here, there = ctx.Pipe()
    proc = ctx.Process(target=target, args=(*args, there), daemon=True)
    proc.start()
    try:
        if not here.poll(120):
            raise RuntimeError(f"{target.__name__} did not start")
        yield here.recv()
    finally:
        proc.terminate()
        proc.join(30)


@contextlib.contextmanager
def _s3rver() -> Iterator[str]:
    """s3rver (Node) on a free port over a temporary directory, bucket created; stopped after."""
    exe = os.environ.get("S3RVER") or shutil.which("s3rver")
    if not exe:
        raise SystemExit("s3rver not found: npm install s3rver@3.7.1, then put it on PATH or set S3RVER")
    with tempfile.TemporaryDirectory(prefix="s3rver-") as data:
        proc = subprocess.Popen([exe, "-d", data, "-a", "127.0.0.1", "-p", "0", "--configure-bucket", _BUCKET],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
        try:
            assert proc.stdout is not None
            for line in proc.stdout:
                m = re.search(r"listening on ([\d.]+:\d+)", line)
                if m:
                    break
            else:
                raise RuntimeError("s3rver exited before it listened")
            _drain(proc.stdout)
            yield f"http://{m.group(1)}"
        finally:
            proc.terminate()
            proc.wait(30)


def _drain(stream) -> None:
    """Read a child's output in a thread so that it never blocks on a full pipe."""
    import threading

    threading.Thread(target=lambda: [None for _ in stream], daemon=True).start()


@contextlib.contextmanager
def _server(url: str) -> Iterator[tuple[str, str, str]]:
    """``(s3 url, endpoint, server name)``: a server started here for ``moto``/``s3rver``, else ``$AWS_ENDPOINT_URL``."""
    if url == "s3rver":
        os.environ.update({"AWS_ACCESS_KEY_ID": "S3RVER", "AWS_SECRET_ACCESS_KEY": "S3RVER"})
        os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
        with _s3rver() as endpoint:
            yield f"s3://{_BUCKET}/store", endpoint, "s3rver"
    elif url == "moto":
        os.environ.update({"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench"})
        os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
        with _process(_serve_moto) as endpoint:
            import boto3

            boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket=_BUCKET)
            yield f"s3://{_BUCKET}/store", endpoint, "moto"
    else:
        endpoint = os.environ.get("AWS_ENDPOINT_URL")
        if not endpoint:
            raise SystemExit("--store-url s3://... needs AWS_ENDPOINT_URL (the proxy goes in front of it)")
        yield url, endpoint, endpoint


def bench_object_store(
    url: str, *, quick: bool, latency_ms: float, tmp: Path, write_store, time_loader
) -> dict:
    """Loader GB/s local vs object store, direct and behind the latency proxy; ``write_store(path,
    tokens)`` builds the local store, ``time_loader(store, plan, seq, threads)`` is one checked
    pass of the loader, in seconds."""
    with (
        _server(url) as (s3_url, endpoint, name),
        _process(_serve_proxy, endpoint, latency_ms / 1000) as proxy,
    ):
        return {"server": name} | _measure(s3_url, endpoint, proxy, quick=quick, latency_ms=latency_ms, tmp=tmp,
                        write_store=write_store, time_loader=time_loader)  # fmt: skip


def _measure(url: str, endpoint: str, proxy: str, *, quick: bool, latency_ms: float, tmp: Path, write_store,
             time_loader) -> dict:  # fmt: skip
    from hsgen.store import HiddenStateStore
    from spectrain.data.sources import StoreSource

    os.environ["AWS_ENDPOINT_URL"] = endpoint
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
    ladder = [1, 16] if quick else [1, 4, 16, 64, 128]
    repeats = 1 if quick else 3
    nbytes = src.stats()["bytes"]
    local_rates: list[float] = []
    rates: dict[str, dict[int, list[float]]] = {
        "direct": {t: [] for t in ladder},
        "latency": {t: [] for t in ladder},
    }
    for _ in range(repeats):  # interleaved: the neighbours' load moves all three alike
        local_rates.append(nbytes / time_loader(local, plan, seq, 2) / 1e9)
        for t in ladder:
            for name, via in (("direct", endpoint), ("latency", proxy)):
                os.environ["AWS_ENDPOINT_URL"] = via
                rates[name][t].append(nbytes / time_loader(url, plan, seq, t) / 1e9)
    os.environ["AWS_ENDPOINT_URL"] = endpoint
    local_gbps = statistics.median(local_rates)
    med = {name: {t: statistics.median(v) for t, v in r.items()} for name, r in rates.items()}
    best_direct = max(med["direct"].values())
    hiding = {t: r / best_direct for t, r in med["latency"].items()}
    return {
        "object_store_url": url,
        "added_latency_ms": latency_ms,
        "tokens": tokens,
        "bytes": nbytes,
        "local_loader_gbps": round(local_gbps, 4),
        "direct_loader_gbps": {str(t): round(r, 4) for t, r in med["direct"].items()},
        "object_store_loader_gbps": {str(t): round(r, 4) for t, r in med["latency"].items()},
        "direct_ratio": {str(t): round(r / local_gbps, 4) for t, r in med["direct"].items()},
        "object_store_ratio": {str(t): round(r / local_gbps, 4) for t, r in med["latency"].items()},
        "latency_hidden_ratio": {str(t): round(r, 4) for t, r in hiding.items()},
        "reads_in_flight_for_0.8x": next((t for t in ladder if med["latency"][t] >= 0.8 * local_gbps), None),
        "reads_in_flight_for_0.8x_of_direct": next((t for t in ladder if hiding[t] >= 0.8), None),
    }
