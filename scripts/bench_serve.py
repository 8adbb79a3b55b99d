#!/usr/bin/env python
"""Throughput of the reference server (``hsgen serve``) and fidelity of its capacity model.

Starts ``hsgen serve --model tiny`` as a child process and drives it with a client that
knows only vLLM's protocol: ``C`` concurrent workers each POST ``/v1/completions`` with a
token-id prompt, wait for the file's ``.lock``, read the file and delete it. Two phases:

1. **raw**: the server as fast as the CPU allows (continuous batching, tiny model).
2. **capacity**: with ``--capacity tokens_per_s=T,max_seqs=S`` the server must spend time
   like a GPU doing prefill; the measured prompt tokens/s should approach ``T``.

Last stdout line: JSON with ``raw_requests_per_s``, ``raw_prompt_tokens_per_s``,
``raw_p50_latency_s``, ``raw_mean_batch``, ``capacity_target_tokens_per_s``,
``capacity_prompt_tokens_per_s``, ``capacity_ratio``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import random
import statistics
import sys
import tempfile
import time

import aiohttp

from hsgen.protocol import extraction as protocol
from hsgen.serve.testing import running_server, wait_for_file

log = logging.getLogger("bench_serve")


async def _drive(url: str, prompts: list[list[int]], concurrency: int) -> tuple[float, list[float], dict]:
    queue: asyncio.Queue[list[int]] = asyncio.Queue()
    for p in prompts:
        queue.put_nowait(p)
    latencies: list[float] = []
    loop = asyncio.get_running_loop()

    async def worker(session: aiohttp.ClientSession) -> None:
        while not queue.empty():
            prompt = queue.get_nowait()
            t0 = time.perf_counter()
            async with session.post(
                f"{url}/v1/completions", json=protocol.completion_request(url.model_name, prompt)
            ) as r:
                body = await r.json()
                if r.status != 200:
                    raise RuntimeError(f"server answered {r.status}: {body}")
            result = protocol.parse_extraction_response(body)
            path = result.hidden_states_path
            await loop.run_in_executor(None, wait_for_file, path, 60.0)
            with open(path, "rb") as f:
                header = protocol.read_safetensors_header(f, os.path.getsize(path))
                f.seek(header[protocol.HIDDEN_STATES_KEY].start)
                f.read(header[protocol.HIDDEN_STATES_KEY].nbytes)
            os.remove(path)
            if os.path.exists(protocol.lock_path(path)):
                os.remove(protocol.lock_path(path))
            latencies.append(time.perf_counter() - t0)

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency)) as session:
        async with session.get(f"{url}/metrics") as r:
            before = protocol.parse_prometheus(await r.text())
        t0 = time.perf_counter()
        await asyncio.gather(*(worker(session) for _ in range(concurrency)))
        wall = time.perf_counter() - t0
        async with session.get(f"{url}/metrics") as r:
            after = protocol.parse_prometheus(await r.text())
    delta = {k: after[k] - before.get(k, 0.0) for k in after if k.endswith("_total")}
    return wall, latencies, delta


def _phase(name: str, url, prompts, concurrency) -> dict:
    wall, lat, delta = asyncio.run(_drive(url, prompts, concurrency))
    tokens = sum(len(p) for p in prompts)
    steps = max(1.0, delta.get("hsgen:engine_steps_total", 1.0))
    out = {
        "requests_per_s": len(prompts) / wall,
        "prompt_tokens_per_s": tokens / wall,
        "p50_latency_s": statistics.median(lat),
        "mean_batch": len(prompts) / steps,
    }
    log.info("%s: %d requests, %d tokens in %.2f s: %s", name, len(prompts), tokens, wall, out)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small run (~1 minute on 2 cores)")
    ap.add_argument("--requests", type=int, default=None, help="requests per phase [quick: 60, full: 600]")
    ap.add_argument("--prompt-len", type=int, default=256, help="tokens per prompt (uniform 50%%..150%%)")
    ap.add_argument("--concurrency", type=int, default=32, help="concurrent client workers")
    ap.add_argument(
        "--target-tokens-per-s",
        type=float,
        default=3000.0,
        help="capacity model prefill rate (below the raw rate)",
    )
    ap.add_argument("--layers", default="1,2,4", help="layer ids to extract from the tiny model")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s: %(message)s")
    n = args.requests or (60 if args.quick else 600)
    rng = random.Random(0)
    prompts = [
        [rng.randrange(3, 1000) for _ in range(rng.randint(args.prompt_len // 2, args.prompt_len * 3 // 2))]
        for _ in range(n)
    ]
    result: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="bench-serve-") as shared:
        log.info("phase raw: starting hsgen serve --model tiny")
        with running_server("tiny", args.layers, shared, mode="process", torch_threads=1) as url:
            raw = _phase("raw", url, prompts, args.concurrency)
        cap = f"tokens_per_s={args.target_tokens_per_s},max_seqs=16,overhead=0.002"
        log.info("phase capacity: %s", cap)
        with running_server("tiny", args.layers, shared, mode="process", capacity=cap) as url:
            capped = _phase("capacity", url, prompts, args.concurrency)
    result = {
        "raw_requests_per_s": round(raw["requests_per_s"], 2),
        "raw_prompt_tokens_per_s": round(raw["prompt_tokens_per_s"], 1),
        "raw_p50_latency_s": round(raw["p50_latency_s"], 4),
        "raw_mean_batch": round(raw["mean_batch"], 2),
        "capacity_target_tokens_per_s": args.target_tokens_per_s,
        "capacity_prompt_tokens_per_s": round(capped["prompt_tokens_per_s"], 1),
        "capacity_ratio": round(capped["prompt_tokens_per_s"] / args.target_tokens_per_s, 3),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
