"""Hand-written parts against the maintained libraries that could replace them, side by side.

- Prometheus text: ``hsgen.protocol.extraction.parse_prometheus`` (a line parser) against prometheus_client's
  parser, on a vLLM-sized ``/metrics`` page (the client polls every server every 50 ms).
- Sample checksums: the store's ``bsum64`` (format version 1) against ``xxh3`` (version 2,
  ``xxhash``) over the same numpy buffers, and zlib CRC-32, on one sample of realistic size.
- Retries: what the client's tenacity retry loop (``hsgen.client.retry``) adds to a fetch that succeeds
  at once, against awaiting the same coroutine bare (the hand-written loop it replaced cost no
  more than that).

Prints its figures as one JSON object on the LAST stdout line. ``--quick`` takes seconds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

import numpy as np


def _vllm_metrics_page(models: int = 1) -> str:
    lines = []
    for m in range(models):
        lab = f'model_name="Qwen/Qwen3-8B-{m}",engine="0"'
        for name, kind in (("vllm:num_requests_running", "gauge"), ("vllm:num_requests_waiting", "gauge"),
                           ("vllm:kv_cache_usage_perc", "gauge"), ("vllm:prompt_tokens_total", "counter"),
                           ("vllm:generation_tokens_total", "counter")):  # fmt: skip
            lines += [f"# HELP {name} x", f"# TYPE {name} {kind}", f"{name}{{{lab}}} {m + 3.0}"]
        for hist in ("vllm:time_to_first_token_seconds", "vllm:e2e_request_latency_seconds",
                     "vllm:request_prompt_tokens", "vllm:request_generation_tokens"):  # fmt: skip
            lines += [f"# HELP {hist} x", f"# TYPE {hist} histogram"]
            for le in (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1, 2.5, 5, 7.5, 10, 20, 40,
                       80, 160, 640, 2560, "+Inf"):  # fmt: skip
                lines.append(f'{hist}_bucket{{{lab},le="{le}"}} 7.0')
            lines += [f"{hist}_sum{{{lab}}} 12.5", f"{hist}_count{{{lab}}} 7.0"]
    return "\n".join(lines) + "\n"


def _library_parse(text: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            values[s.name] = values.get(s.name, 0.0) + float(s.value)
    return values


def _time(fn, *args, repeat: int) -> float:
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(repeat):
            fn(*args)
        best = min(best, (time.perf_counter() - t0) / repeat)
    return best


async def _retry_overhead_us(calls: int) -> tuple[float, float]:
    """Microseconds per call: (awaited bare, inside the client's tenacity retry loop)."""
    from hsgen.client.retry import retrying

    async def attempt() -> int:
        return 1

    async def bare() -> None:
        for _ in range(calls):
            await attempt()

    async def wrapped() -> None:
        for _ in range(calls):
            async for trial in retrying(3, 0.5, 30.0, sleep=asyncio.sleep, label="p"):
                with trial:
                    await attempt()

    best = {bare: float("inf"), wrapped: float("inf")}
    for _ in range(3):
        for fn in best:
            t0 = time.perf_counter()
            await fn()
            best[fn] = min(best[fn], (time.perf_counter() - t0) / calls * 1e6)
    return best[bare], best[wrapped]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smaller sample and fewer repeats")
    ap.add_argument("--tokens", type=int, default=2048, help="tokens of the checksummed sample")
    ap.add_argument("--hidden", type=int, default=4096)
    args = ap.parse_args()

    from hsgen.protocol.extraction import parse_prometheus
    from hsgen.store.codecs import checksum

    page = _vllm_metrics_page()
    assert parse_prometheus(page) == _library_parse(page)
    rep = 50 if args.quick else 500
    t_lib = _time(_library_parse, page, repeat=rep)
    t_hand = _time(parse_prometheus, page, repeat=rep)

    tokens = 512 if args.quick else args.tokens
    rng = np.random.default_rng(0)
    hidden = rng.integers(0, 1 << 16, size=(tokens, 4, args.hidden), dtype=np.uint16)
    arrays = [hidden, np.arange(tokens, dtype=np.int64), np.ones(tokens, np.uint8)]
    nbytes = sum(a.nbytes for a in arrays)

    rep = 5 if args.quick else 20
    t_bsum, t_xxh3, t_crc = (_time(checksum, arrays, alg, repeat=rep) for alg in ("bsum64", "xxh3", "crc32"))
    bare_us, tenacity_us = asyncio.run(_retry_overhead_us(2000 if args.quick else 20000))
    out = {
        "prometheus_page_lines": page.count("\n"),
        "prometheus_client_ms": round(t_lib * 1e3, 4),
        "prometheus_hand_ms": round(t_hand * 1e3, 4),
        "prometheus_client_over_hand": round(t_lib / t_hand, 2),
        "checksum_sample_mib": round(nbytes / 2**20, 1),
        "bsum64_gb_s": round(nbytes / t_bsum / 1e9, 2),
        "xxh3_gb_s": round(nbytes / t_xxh3 / 1e9, 2),
        "crc32_gb_s": round(nbytes / t_crc / 1e9, 2),
        "xxh3_over_bsum64_speed": round(t_bsum / t_xxh3, 2),
        "fetch_bare_us": round(bare_us, 2),
        "fetch_in_tenacity_us": round(tenacity_us, 2),
        "tenacity_overhead_us": round(tenacity_us - bare_us, 2),
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
