"""Benchmark online training's data path: does the trainer wait when the servers keep up?

A reference server (``hsgen serve --model tiny``) runs with a capacity model (a GPU's prefill
tokens/s and concurrency), in its own process. A simulated trainer reads packed sequences
through :class:`spectrain.online.OnlineSource` and :class:`spectrain.data.sources.PackedLoader` exactly
as ``spectrain train --online`` does, spends a fixed time per optimizer step (the GPU's work),
then reports the step's samples consumed (``--delete-consumed``). The server's capacity is set
to ``--headroom`` times the trainer's consumption.

Measured: the fraction of trainer time spent waiting for data (steady state: after
``--warmup-steps`` steps, while the pipeline first fills; the warm-up's wait is reported
separately on stderr), and the peak bytes of the scratch directory (polled every 5 ms by a
watcher thread) and of fetched samples held in memory (``held_peak_bytes``: read-once, the
default) against the configured bound.

Also measured: milliseconds to render one prompt locally (what the trainer spends per prompt when
it sizes an online run's LR schedule).

Realistic mode (``--mode realistic``; ``all``, the default, runs both): the reference byte rate.
Files of the reference layout (hidden size 4096 x 4 layers, bf16, ~1.5k-token prompts) are
written once; an *instant server* (its own process, speaking vLLM's protocol) answers each
request at once by hard-linking the prompt's file into the shared directory. A trainer consumes
through ``OnlineSource`` + ``PackedLoader`` (8192-token sequences) as fast as it can, and the same
bytes are read raw (``preadv`` of each file into a reused page-locked buffer, 1 and ``--threads``
threads, the better counts), interleaved and repeated in one run: ``online_gbps`` and
``online_ratio`` (the default with ``--delete-consumed``: each fetched sample read once, server
file -> validated -> batch, one copy), and the same with the scratch store
(``persist_fetched=true``: ``online_gbps_scratch``, ``online_ratio_scratch``, on a shorter pass).
Rates are whole passes (each pays one pipeline fill), of 2.1 GB (``--quick``: 16k tokens x 4) or 17 GB. Then a
trainer stepping at half that ceiling (a sleep per step) gives ``real_wait_fraction``.

Last stdout line: ``{"wait_fraction", "scratch_peak_bytes", "scratch_bound_bytes",
"render_ms_per_prompt", "online_gbps", "online_ratio", "real_wait_fraction", ...}``.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import threading
import time
from pathlib import Path

from shm import scratch_root  # scripts/shm.py

log = logging.getLogger("bench_online")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--quick", action="store_true", help="150 prompts, 2.1 GB passes (~30 s of CPU on 2 cores)"
    )
    ap.add_argument("--prompts", type=int, default=905, help="prompts from the sample chats")
    ap.add_argument("--warmup-steps", type=int, default=3, help="first steps left out of wait_fraction")
    ap.add_argument("--seq-len", type=int, default=2048, help="tokens per packed sequence (one per step)")
    ap.add_argument("--step-s", type=float, default=0.4, help="simulated GPU time per optimizer step")
    ap.add_argument("--headroom", type=float, default=2.0, help="server capacity / trainer consumption")
    ap.add_argument("--max-seqs", type=int, default=32, help="server concurrent sequences")
    ap.add_argument("--scratch-mb", type=float, default=8.0, help="scratch bound, MiB")
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument(
        "--loader-prefetch", type=int, default=32, help="spectrain train --prefetch: samples read ahead"
    )
    ap.add_argument(
        "--shard-kb", type=int, default=0, help="scratch shard size, KiB (0: the default, bound/16)"
    )
    ap.add_argument("--mode", choices=["all", "tiny", "realistic"], default="all",
                    help="tiny: the 64-wide server against a paced trainer; realistic: reference byte rates")  # fmt: skip
    ap.add_argument("--threads", type=int, default=2, help="realistic: loader read threads")
    ap.add_argument("--repeats", type=int, default=None, help="realistic: interleaved repeats (default 3)")
    ap.add_argument("--tmp-dir", default=None,
                    help="where the files go (default /dev/shm when it has 4 GB free, else the system temp dir)")  # fmt: skip
    args = ap.parse_args()
    args.tmp_dir = args.tmp_dir or scratch_root(4e9)  # scripts/shm.py
    if args.quick:
        args.prompts = min(args.prompts, 150)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("hsgen").setLevel(logging.WARNING)
    logging.getLogger("spectrain").setLevel(logging.WARNING)
    result = {}
    if args.mode in ("all", "tiny"):
        result.update(tiny_bench(args))
    if args.mode in ("all", "realistic"):
        from online_realistic import realistic_bench  # scripts/online_realistic.py

        result.update(realistic_bench(quick=args.quick, threads=args.threads, repeats=args.repeats,
                                      tmp_dir=args.tmp_dir))  # fmt: skip
    print(json.dumps(result))


def tiny_bench(args) -> dict:
    """The paced-trainer run against the tiny reference server (see the module docstring)."""
    import torch

    from hsgen.hf.tiny import ensure_tiny_model
    from hsgen.inputs.sample_data import sample_chats_path
    from hsgen.serve.testing import running_server
    from spectrain.data.sources import PackedLoader
    from spectrain.online import OnlineConfig, OnlineSource, dir_bytes

    torch.set_num_threads(1)
    model = ensure_tiny_model()
    consumption = args.seq_len / args.step_s
    capacity = f"tokens_per_s={consumption * args.headroom:.0f},max_seqs={args.max_seqs}"
    bound = int(args.scratch_mb * (1 << 20))
    with tempfile.TemporaryDirectory(prefix="bench-online-", dir=args.tmp_dir) as tmp_name:
        tmp = Path(tmp_name)
        lines = Path(sample_chats_path()).read_text().splitlines()[: args.prompts]
        (tmp / "p.jsonl").write_text("\n".join(lines) + "\n")
        render_ms = render_ms_per_prompt(tmp / "p.jsonl", model)
        log.info("trainer consumes %.0f tokens/s; server capacity %s; scratch bound %d bytes", consumption, capacity,
                 bound)  # fmt: skip
        with running_server(model, [1, 2, 4], tmp / "hs", capacity=capacity, mode="process") as url:
            cfg = OnlineConfig(
                endpoints=[url], prompts=[str(tmp / "p.jsonl")], store=str(tmp / "store"), verifier=str(model),
                save_path=str(tmp / "save"), layer_ids=[1, 2, 4], scratch_dir=str(tmp / "scratch"),
                scratch_bytes=bound, delete_consumed=True, shared_dir=str(url.shared_dir),
                shard_bytes=args.shard_kb << 10 or None,
            )  # fmt: skip
            src = OnlineSource(cfg)
            _ = src.header
            peak = [0]
            stop = threading.Event()

            def watch() -> None:
                while not stop.is_set():
                    peak[0] = max(peak[0], dir_bytes(tmp / "scratch"))
                    time.sleep(0.005)

            watcher = threading.Thread(target=watch, daemon=True)
            watcher.start()
            waits: list[float] = []
            steps: list[float] = []
            tokens = 0
            t_start = time.perf_counter()
            try:
                for epoch in range(args.epochs):
                    plan = src.plan(epoch)
                    batches = iter(PackedLoader(src, plan, total_seq_len=args.seq_len, layers=None,
                                                hidden_dtype=torch.float32, prefetch=args.loader_prefetch))  # fmt: skip
                    while True:
                        t0 = time.perf_counter()
                        b = next(batches, None)
                        if b is None:
                            break
                        wait = time.perf_counter() - t0
                        time.sleep(args.step_s)  # the GPU's forward, backward and optimizer step
                        src.consumed(b.sample_ids)
                        waits.append(wait)
                        steps.append(time.perf_counter() - t0)
                        tokens += b.num_tokens
                        if len(steps) % 20 == 0:
                            log.info("step %d: wait %.1f ms, scratch %.2f MB", len(steps), wait * 1e3,
                                     dir_bytes(tmp / "scratch") / 1e6)  # fmt: skip
            finally:
                stop.set()
                watcher.join()
                stats = src.stats()
                src.close()
            elapsed = time.perf_counter() - t_start
    if len(steps) <= args.warmup_steps or stats["samples_failed"]:
        # nothing (or too little) was fetched and trained on: no figure to print
        raise SystemExit(f"bench_online: the tiny part did not run whole: {len(steps)} steps (warm-up "
                         f"{args.warmup_steps}), {stats['samples_failed']} samples failed")  # fmt: skip
    k = args.warmup_steps
    steady = sum(waits[k:]) / max(sum(steps[k:]), 1e-9)
    overall = sum(waits) / max(sum(steps), 1e-9)
    detail = {
        "steps": len(steps),
        "tokens_per_s": tokens / elapsed,
        "consumption_tokens_per_s": consumption,
        "capacity": capacity,
        "wait_fraction_including_first_step": overall,
        "warmup_wait_s": sum(waits[:k]),
        "waits_ms": [round(w * 1e3, 1) for w in waits],
        "source": stats,
    }
    print(json.dumps(detail), file=sys.stderr)
    return {"wait_fraction": steady, "scratch_peak_bytes": peak[0], "scratch_bound_bytes": bound,
            "held_peak_bytes": stats["held_peak_bytes"], "render_ms_per_prompt": render_ms}  # fmt: skip


def render_ms_per_prompt(prompts: Path, model: Path) -> float:
    """Milliseconds to render one prompt locally (what sizing the LR schedule costs per prompt online)."""
    from hsgen.inputs.formats import read_inputs
    from hsgen.inputs.render import ChatRenderer, RenderConfig

    renderer = ChatRenderer(RenderConfig(tokenizer_path=str(model)))
    samples = list(read_inputs([str(prompts)]))
    t0 = time.perf_counter()
    for sample in samples:
        renderer.render(sample)
    return round((time.perf_counter() - t0) / len(samples) * 1e3, 3)


if __name__ == "__main__":
    main()
