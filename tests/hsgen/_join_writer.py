"""A joined generator in its own process (tests/hsgen/store/test_join.py kills it with SIGKILL).

Usage: python _join_writer.py URL SHARED STORE N_PROMPTS CHUNK
"""

import asyncio
import sys

from hsgen.client.config import ClientConfig
from hsgen.client.saturate import SaturationConfig
from hsgen.generate.pipeline import GenerateConfig, generate
from hsgen.inputs.render import RenderedPrompt
from hsgen.store import HiddenStateStore, StoreHeader


def prompts(n: int) -> list[RenderedPrompt]:
    return [
        RenderedPrompt(f"s{i:04d}", [i, i + 1, i + 2, (i * 7) % 50 + 1], [0, 1, 1, 1])
        for i in range(1, n + 1)
    ]


def main() -> None:
    url, shared, store_path, n, chunk = sys.argv[1:6]
    store = HiddenStateStore.create(store_path, StoreHeader("fake-model", (1, 2, 4), 8, "float32"))
    client = ClientConfig(
        endpoints=[url], shared_dir=shared, backoff_s=0.01, file_wait_s=2, request_timeout_s=10
    )
    cfg = GenerateConfig(
        client=client,
        saturation=SaturationConfig(concurrency=4),
        shard_bytes=2048,
        commit_interval_s=0.1,
        max_buffer_bytes=4096,  # what a kill loses is bounded: a few samples in flight and buffered
        join=True,
        join_chunk=int(chunk),
    )
    summary = asyncio.run(generate(cfg, lambda: iter(prompts(int(n))), store, progress=False))
    print(summary.to_json(), flush=True)
    sys.exit(summary.exit_code)


if __name__ == "__main__":
    main()
