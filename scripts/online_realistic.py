"""The realistic mode of ``scripts/bench_online.py``: online training's data path at reference byte rates.

See ``bench_online.py``'s docstring. Pieces: :func:`write_files` (one safetensors file per
prompt, as vLLM writes them), :func:`instant_server` (answers each request at once with a hard
link of its prompt's file), :class:`RawFiles` (the raw ``preadv`` baseline) and
:func:`online_pass` (``OnlineSource`` + ``PackedLoader``, optionally at a fixed step time). Online throughput is
the whole pass's bytes over its time, from the first request on (one pipeline fill per pass included).
"""

from __future__ import annotations

import hashlib
import json
import logging
import multiprocessing
import os
import statistics
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

log = logging.getLogger("bench_online")

LAYERS = [1, 2, 3, 4]
HIDDEN = 4096
SEQ = 8192
VOCAB = 1088  # the tiny verifier's, whose tokenizer renders the token-id prompts


def _key(ids) -> str:
    return hashlib.sha1(np.asarray(ids, dtype=np.int64).tobytes()).hexdigest()


def write_prompts(prompts: Path, records: list[str], copies: int) -> None:
    """The prompts ``copies`` times over under distinct ids (the server answers each copy with its file)."""
    with open(prompts, "w") as out:
        for c in range(copies):
            for line in records:
                rec = json.loads(line)
                rec["id"] = f"{rec['id']}-c{c}"
                out.write(json.dumps(rec) + "\n")


def write_files(directory: Path, prompts: Path, total_tokens: int) -> list[int]:
    """Token-id prompts (JSONL) and one vLLM-style file per prompt (hidden 4 x 4096 bf16); their lengths."""
    from hsgen.protocol import extraction as protocol

    rng = np.random.default_rng(0)
    row = len(LAYERS) * HIDDEN
    base = (rng.standard_normal(row * 64, dtype=np.float32).view(np.uint32) >> 16).astype(np.uint16)
    lengths: list[int] = []
    directory.mkdir(parents=True)
    with open(prompts, "w") as out:
        while sum(lengths) < total_tokens:
            n = int(np.clip(rng.lognormal(7.2, 0.7), 64, SEQ))
            ids = rng.integers(1, VOCAB, n).tolist()
            out.write(json.dumps({"id": f"p{len(lengths):05d}", "input_ids": ids}) + "\n")
            hidden = np.resize(np.roll(base, len(lengths)), n * row)
            header, _ = protocol.safetensors_header_bytes(
                [("hidden_states", "bfloat16", (n, len(LAYERS), HIDDEN)), ("token_ids", "int64", (n,))]
            )
            with open(directory / f"{_key(ids)}.safetensors", "wb") as f:
                f.write(header)
                f.write(hidden.tobytes())
                f.write(np.asarray(ids, dtype=np.int64).tobytes())
            lengths.append(n)
    return lengths


def _serve(master: str, shared: str, port_out) -> None:
    """The instant server (child process): vLLM's completion response at once, the file hard-linked."""
    import asyncio

    from aiohttp import web

    from hsgen.protocol import extraction as protocol

    async def models(_request):
        return web.json_response({"object": "list", "data": [{"id": "bench", "object": "model"}]})

    answers: dict[bytes, tuple[str, list[bytes]]] = {}  # request body -> (file, response around id and path)

    def answer_for(raw: bytes) -> tuple[str, list[bytes]]:
        ids = json.loads(raw)["prompt"]
        response = json.dumps({
            "id": "@ID@", "object": "text_completion", "model": "bench",
            "choices": [{"index": 0, "text": "", "prompt_token_ids": ids, "token_ids": [], "finish_reason": "length"}],
            "usage": {"prompt_tokens": len(ids), "completion_tokens": 1, "total_tokens": len(ids) + 1},
            "kv_transfer_params": {"hidden_states_path": "@PATH@"},
        })  # fmt: skip
        head, rest = response.split('"@ID@"')
        middle, tail = rest.split('"@PATH@"')
        return os.path.join(master, f"{_key(ids)}.safetensors"), [s.encode() for s in (head, middle, tail)]

    async def completions(request):
        # A real server's front-end runs on its own cores, not the trainer's: this one decodes and
        # encodes JSON once per distinct body and answers from bytes afterwards (half the CPU).
        raw = await request.read()
        rid = request.headers.get("X-Request-Id") or uuid.uuid4().hex[:16]
        answer = answers.get(raw)
        if answer is None:
            answer = answers[raw] = answer_for(raw)
        source, (head, middle, tail) = answer
        path = os.path.join(shared, protocol.hidden_states_filename(rid))
        os.link(source, path)
        body = b"".join((head, json.dumps(f"cmpl-{rid}").encode(), middle, json.dumps(path).encode(), tail))
        return web.Response(body=body, content_type="application/json")

    async def main() -> None:
        app = web.Application(client_max_size=1 << 30)
        app.add_routes([web.get("/v1/models", models), web.post("/v1/completions", completions)])
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port_out.put(site._server.sockets[0].getsockname()[1])
        await asyncio.Event().wait()

    asyncio.run(main())


class instant_server:
    """Context manager: the instant server in its own process; ``url`` while running."""

    def __init__(self, master: Path, shared: Path):
        self.master, self.shared = master, shared

    def __enter__(self) -> str:
        ctx = multiprocessing.get_context("fork")
        q = ctx.Queue()
        self.proc = ctx.Process(target=_serve, args=(str(self.master), str(self.shared), q), daemon=True)
        self.proc.start()
        return f"http://127.0.0.1:{q.get(timeout=60)}"

    def __exit__(self, *exc) -> None:
        self.proc.terminate()
        self.proc.join(10)


class RawFiles:
    """The baseline: each file's hidden states and token ids read with ``preadv`` into one reused buffer."""

    def __init__(self, master: Path):
        from hsgen.protocol import extraction as protocol

        self.spans = []
        for path in sorted(master.glob("*.safetensors")):
            with open(path, "rb") as f:
                tensors = protocol.read_safetensors_header(f, path.stat().st_size)
            hs, ti = tensors["hidden_states"], tensors["token_ids"]
            self.spans.append((str(path), hs.start, hs.nbytes, ti.start, ti.nbytes))
        self.nbytes = sum(h + t for _, _, h, _, t in self.spans)
        biggest = max(h + t for _, _, h, _, t in self.spans)
        self.buffers = [self._buffer(biggest) for _ in range(2)]

    @staticmethod
    def _buffer(n: int) -> memoryview:
        t = torch.empty(n, dtype=torch.uint8, pin_memory=torch.cuda.is_available())
        t.fill_(0)
        return memoryview(t.numpy())

    def read(self, part: slice = slice(None), buf: int = 0, copies: int = 1) -> None:
        view = self.buffers[buf]
        for path, h0, hn, t0, tn in self.spans[part] * copies:
            fd = os.open(path, os.O_RDONLY)
            try:
                for off, n, at in ((h0, hn, 0), (t0, tn, hn)):
                    done = 0
                    while done < n:
                        got = os.preadv(fd, [view[at + done : at + n]], off + done)
                        if got <= 0:
                            raise EOFError(path)
                        done += got
            finally:
                os.close(fd)

    def read_threads(self, threads: int, copies: int = 1) -> None:
        """:meth:`read` of every span, split across ``threads`` threads, each into its own buffer; a
        thread's error is raised here (a thread that died would make the rate count bytes never read)."""
        if threads <= 1:
            return self.read(copies=copies)
        while len(self.buffers) < threads:
            self.buffers.append(self._buffer(len(self.buffers[0])))
        k = -(-len(self.spans) // threads)
        with ThreadPoolExecutor(threads) as pool:
            jobs = [pool.submit(self.read, slice(i * k, (i + 1) * k), i, copies) for i in range(threads)]
        for job in jobs:
            job.result()


def online_pass(url: str, shared: Path, prompts: Path, model: Path, work: Path, *, persist: bool | None, threads: int,
                bound: int, epochs: int = 1, step_s: float = 0.0, buffers=None) -> dict:  # fmt: skip
    """Train-like consumption through OnlineSource + PackedLoader; bytes/s and per-step waits."""
    from spectrain.data.sources import PackedLoader
    from spectrain.online import OnlineConfig, OnlineSource

    work.mkdir(parents=True)
    cfg = OnlineConfig(
        endpoints=[url], prompts=[str(prompts)], store=str(work / "store"), verifier=str(model),
        save_path=str(work / "save"), layer_ids=LAYERS, scratch_dir=str(work / "scratch"), scratch_bytes=bound,
        delete_consumed=True, persist_fetched=persist, shared_dir=str(shared), saturation={"concurrency": 8},
        client_options={"expect_hidden_size": HIDDEN},  # the stand-in server plays a 4096-wide model, not tiny's
    )  # fmt: skip
    src = OnlineSource(cfg)
    waits: list[float] = []
    nbytes = first = 0
    try:
        _ = src.header  # the first fetch, before the clock: client session and scratch set-up
        t_start = time.perf_counter()
        t_first = None
        for epoch in range(epochs):
            loader = PackedLoader(src, src.plan(epoch), total_seq_len=SEQ, layers=None, hidden_dtype=torch.bfloat16,
                                  pin_memory=torch.cuda.is_available(), read_threads=threads, buffers=buffers)  # fmt: skip
            it = iter(loader)
            while True:
                t0 = time.perf_counter()
                b = next(it, None)
                if b is None:
                    break
                waits.append(time.perf_counter() - t0)
                if step_s:
                    time.sleep(step_s)  # the GPU's step
                src.consumed(b.sample_ids)
                nbytes += b.num_tokens * (len(LAYERS) * HIDDEN * 2 + 8)
                if t_first is None:
                    t_first, first = time.perf_counter(), nbytes
        elapsed = time.perf_counter() - t_start
        after_first = time.perf_counter() - (t_first or t_start)
        stats = src.stats()
    finally:
        src.close()
    if stats["samples_failed"]:
        raise RuntimeError(f"{stats['samples_failed']} samples failed: see {work / 'save'}")
    # The whole pass counts: measured from the first sequence on, the samples fetched ahead while
    # the first one filled (up to the bound) would count without their time.
    return {"gbps": nbytes / max(elapsed, 1e-9) / 1e9, "gbps_after_first": (nbytes - first) / max(after_first, 1e-9) / 1e9,
            "waits": waits, "elapsed": elapsed, "stats": stats}  # fmt: skip


def realistic_bench(
    *, quick: bool, threads: int = 2, repeats: int | None = None, tmp_dir: str = "/dev/shm"
) -> dict:
    """Run the realistic mode (see ``bench_online.py``); returns its keys."""
    from hsgen.hf.tiny import ensure_tiny_model
    from spectrain.data.loader import BufferPool

    repeats = repeats or 3  # an odd count: the median is one measured repeat
    # long passes: a pass pays one pipeline fill (~0.1 s here), which the whole-pass rate includes
    tokens, copies, scratch_copies = (16_000, 4, 1) if quick else (64_000, 8, 3)
    model = ensure_tiny_model()
    bound = 6 * SEQ * len(LAYERS) * HIDDEN * 2  # six packed sequences of read-ahead
    with tempfile.TemporaryDirectory(prefix="bench-online-real-", dir=tmp_dir) as tmp_name:
        tmp = Path(tmp_name)
        shared = tmp / "hs"
        shared.mkdir()
        t0 = time.perf_counter()
        lengths = write_files(tmp / "master", tmp / "unique.jsonl", tokens)
        records = (tmp / "unique.jsonl").read_text().splitlines()
        write_prompts(tmp / "prompts.jsonl", records, copies)  # one pass: long enough to measure
        write_prompts(tmp / "scratch.jsonl", records, scratch_copies)  # the scratch store is 5x slower
        write_prompts(tmp / "paced.jsonl", records, copies)  # one long epoch at half the ceiling
        raw = RawFiles(tmp / "master")
        gb = raw.nbytes * copies / 1e9
        log.info("realistic: %d files, %.2f GB in %.1f s", len(lengths), gb, time.perf_counter() - t0)
        buffers = BufferPool()
        runs: dict[str, list[float]] = {"raw_1": [], "raw_n": [], "once": [], "scratch": []}
        with instant_server(tmp / "master", shared) as url:
            n = 0

            def online(persist: bool | None, prompts: str = "prompts.jsonl", **kw) -> dict:
                nonlocal n
                n += 1
                return online_pass(url, shared, tmp / prompts, model, tmp / f"run{n}", persist=persist,
                                   threads=threads, bound=bound, buffers=buffers, **kw)  # fmt: skip

            def timed(f) -> float:
                t = time.perf_counter()
                f()
                return gb / (time.perf_counter() - t)

            jobs = {
                "raw_1": lambda: timed(lambda: raw.read(copies=copies)),
                "raw_n": lambda: timed(lambda: raw.read_threads(threads, copies)),
                "once": lambda: online(None)["gbps"],  # the default with --delete-consumed: read once
                "scratch": lambda: online(True, prompts="scratch.jsonl")["gbps"],  # persist_fetched=true
            }
            raw.read()
            raw.read_threads(threads)  # its buffers
            online(None)  # warm: page cache, pinned allocator, imports
            order = list(jobs)
            for r in range(repeats):
                for name in order[r % 4 :] + order[: r % 4]:
                    runs[name].append(jobs[name]())
                log.info("realistic repeat %d: %s", r, {k: round(v[-1], 2) for k, v in runs.items()})
            limit = [max(a, b) for a, b in zip(runs["raw_1"], runs["raw_n"], strict=True)]
            ceiling = statistics.median(runs["once"])
            step_s = 2 * SEQ * (len(LAYERS) * HIDDEN * 2 + 8) / (ceiling * 1e9)  # half the ceiling
            paced = online(None, prompts="paced.jsonl", step_s=step_s)
        log.info("realistic paced run: waits per step (ms) %s", [round(w * 1e3, 1) for w in paced["waits"]])
        waits = paced["waits"][2:]  # the first two steps fill the pipeline
        steps = len(paced["waits"])
        wait_fraction = sum(waits) / max(sum(waits) + len(waits) * step_s, 1e-9)
    return {
        "online_gbps": round(ceiling, 3),
        "online_ratio": round(
            statistics.median(o / lim for o, lim in zip(runs["once"], limit, strict=True)), 3
        ),
        "real_wait_fraction": round(wait_fraction, 4),
        "online_gbps_scratch": round(statistics.median(runs["scratch"]), 3),
        "online_ratio_scratch": round(
            statistics.median(o / lim for o, lim in zip(runs["scratch"], limit, strict=True)), 3
        ),
        "online_raw_gbps": round(statistics.median(limit), 3),
        "online_ratios": [round(o / lim, 3) for o, lim in zip(runs["once"], limit, strict=True)],
        "real_steps": steps,
        "real_step_s": round(step_s, 4),
        "online_gb_per_pass": round(gb, 3),
    }
