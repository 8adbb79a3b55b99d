"""A small aiohttp server speaking vLLM's extraction protocol, with scripted behaviours.

Unit tests of the client, saturation and generate pipeline use it instead of the reference
server: no model, exact control over when files and locks appear and how requests fail.
Hidden states are a deterministic function of the token ids: ``value[t, l, h] = ids[t] + l + h / 1000``.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import fcntl
import json
import os
import threading
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import ml_dtypes
import numpy as np
from aiohttp import web

from hsgen.protocol import extraction as protocol

NP_DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}


def expected_states(ids, num_layers: int, hidden: int, dtype: str = "float32") -> np.ndarray:
    """The hidden states the fake server writes for ``ids``, in the logical dtype."""
    ids = np.asarray(ids, dtype=np.float64)
    v = ids[:, None, None] + np.arange(num_layers)[None, :, None] + np.arange(hidden)[None, None, :] / 1000.0
    return v.astype(NP_DTYPES[dtype])


def write_states_file(path: str, hidden: np.ndarray, token_ids: np.ndarray, dtype: str) -> None:
    tensors = [("token_ids", "int64", token_ids.shape), ("hidden_states", dtype, hidden.shape)]
    header, _ = protocol.safetensors_header_bytes(tensors)
    with open(path, "wb") as f:
        f.write(header)
        f.write(np.ascontiguousarray(token_ids, dtype=np.int64).tobytes())
        f.write(np.ascontiguousarray(hidden).tobytes())


HUGE_HIDDEN = 459_649
HUGE_TOKENS = 1_000_000
HUGE_LAYERS = (1024, 65536)
"""``huge_layers``: layers and hidden size of a 1 GiB float32 file for 4 tokens (a hidden size any
model might have, a layer count none was asked for)."""


def write_sparse_states_file(path: str, ids, num_layers: int, dtype: str, fault: str) -> None:
    """A file whose header claims a huge hidden size, token count or layer count, its payload a sparse hole."""
    hidden = HUGE_HIDDEN if fault == "huge_hidden" else 8
    t = HUGE_TOKENS if fault == "huge_tokens" else len(ids)
    if fault == "huge_layers":
        num_layers, hidden = HUGE_LAYERS[0], HUGE_LAYERS[1] * 4 // len(ids)
    tensors = [("token_ids", "int64", (t,)), ("hidden_states", dtype, (t, num_layers, hidden))]
    header, _ = protocol.safetensors_header_bytes(tensors)
    item = np.dtype(NP_DTYPES[dtype]).itemsize
    with open(path, "wb") as f:
        f.write(header)
        f.write(np.asarray(ids, dtype=np.int64).tobytes())
        f.truncate(len(header) + t * 8 + t * num_layers * hidden * item)


@dataclass
class FakeConfig:
    """Behaviour of the fake server.

    Attributes:
        shared_dir: where files are written.
        num_layers, hidden, dtype: the states' shape and dtype.
        mode: ``sync`` (file complete before the response, no lock), ``lock`` (lock held
            before the response, file written ``write_delay_s`` later) or ``late`` (neither
            exists at response time; lock + file appear ``write_delay_s`` later).
        write_delay_s: delay of the write in ``lock``/``late`` modes.
        latency_s: time each request takes before answering.
        api_key: required bearer token (None = none).
        faults: a list of fault names consumed one per request (``None`` = no fault):
            ``http_500``, ``http_400``, ``http_401`` (or any ``http_<status>``), ``missing_file``, ``truncated``, ``nan``,
            ``token_mismatch``, ``outside``, ``stale_lock``, ``hang`` (``hang_s``), ``bad_json``;
            hostile ones: ``symlink_swap`` (the file is named in a subdirectory that becomes a
            symlink to ``outside_dir`` before the file is written there), ``fifo_lock`` and
            ``fifo_file`` (a FIFO where the lock or the file should be), ``huge_hidden`` and
            ``huge_tokens`` (a sparse file whose header claims a huge hidden size or token count),
            ``huge_layers`` (a sparse file of :data:`HUGE_LAYERS` layers, 1 GiB for 4 tokens).
        outside_dir: where ``outside`` and ``symlink_swap`` put their file (default: a sibling of
            ``shared_dir``).
        fault_by_first_token: fault applied to every request whose first token id matches.
        metrics: serve ``/metrics``.
        capacity: sequences per step (None = unlimited, no steps); with ``step_s`` per step.
    """

    shared_dir: str
    num_layers: int = 3
    hidden: int = 8
    dtype: str = "float32"
    mode: str = "sync"
    write_delay_s: float = 0.02
    latency_s: float = 0.0
    api_key: str | None = None
    faults: list = field(default_factory=list)
    fault_by_first_token: dict = field(default_factory=dict)
    metrics: bool = True
    capacity: int | None = None
    step_s: float = 0.05
    model: str = "fake-model"
    hang_s: float = 1.0
    outside_dir: str | None = None


class FakeVLLM:
    """The server. ``async with FakeVLLM(cfg) as url`` or ``with FakeVLLM(cfg).in_thread() as url``."""

    def __init__(self, cfg: FakeConfig):
        self.cfg = cfg
        self.requests = 0
        self.completions: list[list[int]] = []
        self.waiting = 0
        self.running = 0
        self._queue: collections.deque = collections.deque()
        self._runner = None
        self.url = ""
        self._step_task = None
        self._wake: asyncio.Event | None = None
        self._pending_writes: set[asyncio.Task] = set()
        Path(cfg.shared_dir).mkdir(parents=True, exist_ok=True)

    # ------------------------------------------------------------------ app
    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/completions", self.completions_handler)
        app.router.add_get("/metrics", self.metrics_handler)
        app.router.add_get("/health", self.health)
        return app

    def _auth(self, request) -> web.Response | None:
        if self.cfg.api_key and request.headers.get("Authorization") != f"Bearer {self.cfg.api_key}":
            return web.json_response(
                protocol.error_body("bad key", type_="Unauthorized", code=401), status=401
            )
        return None

    async def health(self, request):
        return web.Response(text="ok")

    async def models(self, request):
        return self._auth(request) or web.json_response({"object": "list", "data": [{"id": self.cfg.model}]})

    async def metrics_handler(self, request):
        if not self.cfg.metrics:
            return web.Response(status=404)
        text = (
            f'vllm:num_requests_running{{model_name="{self.cfg.model}"}} {self.running}\n'
            f'vllm:num_requests_waiting{{model_name="{self.cfg.model}"}} {self.waiting}\n'
        )
        return web.Response(text=text)

    async def _run_capacity(self) -> None:
        """Wait for a slot in a step of at most ``capacity`` sequences lasting ``step_s``."""
        fut = asyncio.get_running_loop().create_future()
        self._queue.append(fut)
        self.waiting += 1
        self._wake.set()
        await fut

    async def _steps(self) -> None:
        while True:
            if not self._queue:
                self._wake.clear()
                await self._wake.wait()
                continue
            batch = [self._queue.popleft() for _ in range(min(self.cfg.capacity, len(self._queue)))]
            self.waiting -= len(batch)
            self.running = len(batch)
            await asyncio.sleep(self.cfg.step_s)
            self.running = 0
            for f in batch:
                if not f.done():
                    f.set_result(None)

    async def completions_handler(self, request):
        denied = self._auth(request)
        if denied:
            return denied
        body = await request.json()
        ids = [int(t) for t in body["prompt"]]
        self.requests += 1
        fault = self.cfg.faults.pop(0) if self.cfg.faults else None
        fault = self.cfg.fault_by_first_token.get(ids[0], fault)
        if fault == "hang":
            await asyncio.sleep(self.cfg.hang_s)
        if fault == "http_500":
            return web.json_response(
                protocol.error_body("boom", type_="InternalServerError", code=500), status=500
            )
        if fault == "http_400":
            return web.json_response(
                protocol.error_body("This model's maximum context length is 8"), status=400
            )
        if fault == "http_401":
            return web.json_response(protocol.error_body("nope", code=401), status=401)
        if fault and fault.startswith("http_"):  # any other status: http_408, http_429, http_503, ...
            code = int(fault[5:])
            return web.json_response(protocol.error_body(f"status {code}", code=code), status=code)
        if fault == "bad_json":
            return web.Response(text="not json", status=200)
        if self.cfg.capacity:
            await self._run_capacity()
        elif self.cfg.latency_s:
            await asyncio.sleep(self.cfg.latency_s)
        self.completions.append(ids)
        rid = request.headers.get("X-Request-Id") or uuid.uuid4().hex[:16]
        name = f"cmpl-{rid}-0-{uuid.uuid4().hex[:8]}.safetensors"
        path = os.path.join(self.cfg.shared_dir, name)
        outside = self.cfg.outside_dir or os.path.join(
            os.path.dirname(self.cfg.shared_dir.rstrip("/")), "elsewhere"
        )
        if fault == "outside":
            os.makedirs(outside, exist_ok=True)
            path = os.path.join(outside, name)
        if fault in ("symlink_swap", "fifo_lock", "fifo_file"):
            return self._hostile(fault, ids, name, outside)
        if fault in ("huge_hidden", "huge_tokens", "huge_layers"):
            write_sparse_states_file(path, ids, self.cfg.num_layers, self.cfg.dtype, fault)
            return web.Response(text=json.dumps(self._response(ids, path)), content_type="application/json")
        file_ids = list(ids)
        if fault == "token_mismatch":
            file_ids[0] += 1
        hidden = expected_states(file_ids, self.cfg.num_layers, self.cfg.hidden, self.cfg.dtype)
        if fault == "token_mismatch":
            hidden = expected_states(ids, self.cfg.num_layers, self.cfg.hidden, self.cfg.dtype)
        if fault == "nan":
            hidden[0, 0, 0] = np.nan
        arr_ids = np.asarray(file_ids, dtype=np.int64)
        lock = protocol.lock_path(path)

        def write() -> None:
            if fault == "missing_file":
                return
            write_states_file(path, hidden, arr_ids, self.cfg.dtype)
            if fault == "truncated":
                size = os.path.getsize(path)
                os.truncate(path, size // 2)

        if self.cfg.mode == "sync":
            write()
        else:
            fd = None
            if self.cfg.mode == "lock":
                fd = os.open(lock, os.O_CREAT | os.O_RDWR, 0o644)
                fcntl.flock(fd, fcntl.LOCK_EX)

            async def later(fd=fd) -> None:
                await asyncio.sleep(self.cfg.write_delay_s)
                if fd is None:
                    fd = os.open(lock, os.O_CREAT | os.O_RDWR, 0o644)
                    fcntl.flock(fd, fcntl.LOCK_EX)
                await asyncio.sleep(self.cfg.write_delay_s / 2)
                write()
                if fault == "stale_lock":
                    self._stale = getattr(self, "_stale", []) + [fd]
                    return
                os.close(fd)

            t = asyncio.get_running_loop().create_task(later())
            self._pending_writes.add(t)
            t.add_done_callback(self._pending_writes.discard)
        return web.Response(text=json.dumps(self._response(ids, path)), content_type="application/json")

    def _hostile(self, fault: str, ids: list[int], name: str, outside: str) -> web.Response:
        """Answer with a path, then make it something the client must refuse."""
        cfg = self.cfg
        hidden = expected_states(ids, cfg.num_layers, cfg.hidden, cfg.dtype)
        hidden[...] = 99  # the outside file's bytes: never to be stored
        arr_ids = np.asarray(ids, dtype=np.int64)
        if fault == "symlink_swap":
            sub = os.path.join(cfg.shared_dir, f"d-{uuid.uuid4().hex[:8]}")
            os.makedirs(sub)
            path = os.path.join(sub, name)

            async def swap() -> None:
                await asyncio.sleep(cfg.write_delay_s)
                os.rename(sub, sub + ".moved")
                os.makedirs(outside, exist_ok=True)
                os.symlink(outside, sub)
                write_states_file(os.path.join(outside, name), hidden, arr_ids, cfg.dtype)

            t = asyncio.get_running_loop().create_task(swap())
            self._pending_writes.add(t)
            t.add_done_callback(self._pending_writes.discard)
        else:
            path = os.path.join(cfg.shared_dir, name)
            os.mkfifo(protocol.lock_path(path) if fault == "fifo_lock" else path)
        return web.Response(text=json.dumps(self._response(ids, path)), content_type="application/json")

    def _response(self, ids: list[int], path: str) -> dict:
        return {
            "id": "cmpl-x",
            "object": "text_completion",
            "model": self.cfg.model,
            "choices": [
                {
                    "index": 0,
                    "text": "x",
                    "finish_reason": "length",
                    "prompt_token_ids": ids,
                    "token_ids": [7],
                }
            ],
            "usage": {"prompt_tokens": len(ids), "completion_tokens": 1},
            "kv_transfer_params": {"hidden_states_path": path},
        }

    # ------------------------------------------------------------------ lifecycle
    async def __aenter__(self) -> str:
        self._wake = asyncio.Event()
        if self.cfg.capacity:
            self._step_task = asyncio.get_running_loop().create_task(self._steps())
        self._runner = web.AppRunner(self.app(), access_log=None, shutdown_timeout=1.0)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        return self.url

    async def __aexit__(self, *exc) -> None:
        if self._step_task is not None:
            self._step_task.cancel()
        for t in list(self._pending_writes):
            with contextlib.suppress(Exception):
                await t
        for fd in getattr(self, "_stale", []):
            os.close(fd)
        await self._runner.cleanup()

    @contextlib.contextmanager
    def in_thread(self):
        """Run the server in a background thread with its own loop (for subprocess tests)."""
        loop = asyncio.new_event_loop()
        ready = threading.Event()
        box = {}

        def run():
            asyncio.set_event_loop(loop)
            box["url"] = loop.run_until_complete(self.__aenter__())
            ready.set()
            loop.run_forever()
            loop.run_until_complete(self.__aexit__(None, None, None))
            loop.close()

        th = threading.Thread(target=run, daemon=True)
        th.start()
        ready.wait(30)
        try:
            yield box["url"]
        finally:
            loop.call_soon_threadsafe(loop.stop)
            th.join(30)
