"""Fetch one prompt's hidden states from vLLM servers, validated, with the server's files removed.

``HiddenStateClient`` speaks vLLM's extraction protocol (``docs/serve.md``,
``hsgen.protocol``): one ``POST /v1/completions`` per prompt with its token ids, then the
hand-off through the shared directory: wait for the ``.lock`` (vLLM >= 0.22) or for the file
to appear (0.24+ may write it after the response), map the safetensors file, validate keys,
shape, dtype, token ids and finite values, and delete the file and its lock.

Several endpoints are used at once; each request goes to the least loaded healthy one. Only
transient errors are retried (transport errors, timeouts, HTTP 408/429/5xx, a file missing,
truncated or still locked after the wait), with exponential backoff; a circuit breaker per
endpoint stops sending to a server after consecutive failures and probes it again later.

Usage::

    async with HiddenStateClient(ClientConfig(endpoints=["http://gpu1:8000"], shared_dir="/dev/shm/hs")) as c:
        sample = await c.fetch(rendered_prompt)
"""

from __future__ import annotations

import asyncio
import errno
import fcntl
import json
import logging
import mmap
import os
import random
import time
import uuid
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from hsgen import protocol
from hsgen.render import RenderedPrompt

log = logging.getLogger(__name__)

STORAGE_DTYPES = {"bfloat16": np.uint16, "float16": np.float16, "float32": np.float32}
"""Logical dtype -> numpy dtype the states are kept in (bf16 as raw uint16 bits, like the store)."""

_EXPONENT_MASKS = {"bfloat16": 0x7F80, "float16": 0x7C00}


# --------------------------------------------------------------------------- config and results


@dataclass
class ClientConfig:
    """How to reach the servers and how patient to be.

    Attributes:
        endpoints: server base URLs (``http://host:8000`` or ``http://host:8000/v1``).
        shared_dir: the directory the servers write to (their ``shared_storage_path``, as
            seen from this machine). A file anywhere else is refused.
        api_key: sent as ``Authorization: Bearer``; None = no header.
        model: model id to request; None = ask each server's ``GET /v1/models``.
        include_output_tokens: ask vLLM >= 0.24 to include generated tokens (they are dropped).
        request_timeout_s: limit for one HTTP request, queueing on the server included.
        connect_timeout_s: limit for opening a connection.
        file_wait_s: how long the file or its lock may take to appear after the response.
        lock_timeout_s: how long a writer may hold the lock.
        settle_s: after the lock is released, how long a missing or short file may take to
            become complete before the attempt fails (covers lock-creation races).
        max_retries: extra attempts after a transient failure (0 = no retry).
        backoff_s: first retry delay; doubles per attempt, with jitter, up to ``backoff_max_s``.
        backoff_max_s: longest retry delay.
        breaker_threshold: consecutive transient failures that open an endpoint's breaker.
        breaker_cooldown_s: how long an open breaker rejects requests before one probe.
        check_finite: refuse samples with NaN or infinite values.
        delete_files: remove the server's file and lock after reading (vLLM never does).
        max_connections: keep-alive connections per endpoint (0 = unlimited).
        read_threads: threads mapping and validating files.
    """

    endpoints: Sequence[str]
    shared_dir: str = protocol.DEFAULT_SHARED_STORAGE_PATH
    api_key: str | None = None
    model: str | None = None
    include_output_tokens: bool = False
    request_timeout_s: float = 600.0
    connect_timeout_s: float = 10.0
    file_wait_s: float = 60.0
    lock_timeout_s: float = 300.0
    settle_s: float = 2.0
    max_retries: int = 3
    backoff_s: float = 0.5
    backoff_max_s: float = 30.0
    breaker_threshold: int = 5
    breaker_cooldown_s: float = 10.0
    check_finite: bool = True
    delete_files: bool = True
    max_connections: int = 0
    read_threads: int = 4

    def __post_init__(self) -> None:
        if isinstance(self.endpoints, str):
            self.endpoints = [self.endpoints]
        self.endpoints = [normalize_endpoint(e) for e in self.endpoints]
        if not self.endpoints:
            raise ValueError("at least one endpoint is needed (--endpoint URL)")
        if len(set(self.endpoints)) != len(self.endpoints):
            raise ValueError(f"endpoints are repeated: {self.endpoints}")
        if self.max_retries < 0:
            raise ValueError("max_retries must be >= 0")
        if self.breaker_threshold < 1:
            raise ValueError("breaker_threshold must be >= 1")


def normalize_endpoint(url: str) -> str:
    """``http://h:8000/v1/`` -> ``http://h:8000``; a bare ``h:8000`` gets ``http://``."""
    url = url.strip().rstrip("/")
    if not url:
        raise ValueError("empty endpoint URL")
    if "://" not in url:
        url = "http://" + url
    if url.endswith("/v1"):
        url = url[:-3]
    return url.rstrip("/")


@dataclass
class FetchedSample:
    """One prompt's validated hidden states.

    Attributes:
        sample_id: the prompt's id.
        hidden_states: ``[T, num_layers, hidden]`` in storage dtype (uint16 bits for bf16),
            possibly a read-only view of a mapped file (the file itself is already deleted).
        token_ids: ``[T]`` int64, equal to the prompt's ids.
        loss_mask: ``[T]`` uint8.
        dtype: logical dtype of ``hidden_states``.
        endpoint: the server that produced it.
        latency_s: seconds from sending the request to the validated arrays.
        attempts: requests it took (1 = first try).
    """

    sample_id: str
    hidden_states: np.ndarray
    token_ids: np.ndarray
    loss_mask: np.ndarray
    dtype: str
    endpoint: str = ""
    latency_s: float = 0.0
    attempts: int = 1

    @property
    def nbytes(self) -> int:
        return int(self.hidden_states.nbytes)

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.shape[0])


class FetchError(Exception):
    """A prompt whose hidden states could not be fetched.

    Attributes:
        reason: short machine-readable kind (``http_400``, ``timeout``, ``missing_file``, ...).
        transient: whether another attempt may succeed.
        endpoint: the server involved ("" if none).
        attempts: requests made for this prompt so far.
    """

    def __init__(self, reason: str, message: str, *, transient: bool, endpoint: str = "", attempts: int = 0):
        super().__init__(f"{reason}: {message}")
        self.reason = reason
        self.message = message
        self.transient = transient
        self.endpoint = endpoint
        self.attempts = attempts


class FatalError(FetchError):
    """A failure no other prompt can avoid either (bad API key, wrong server setup)."""

    def __init__(self, reason: str, message: str, endpoint: str = ""):
        super().__init__(reason, message, transient=False, endpoint=endpoint)


# --------------------------------------------------------------------------- endpoints


@dataclass
class CircuitBreaker:
    """Closed -> open after ``threshold`` consecutive failures -> one probe after ``cooldown``."""

    threshold: int
    cooldown_s: float
    failures: int = 0
    open_until: float = 0.0
    probing: bool = False
    opened: int = 0

    def state(self, now: float) -> str:
        """``closed`` (requests flow), ``open`` (cooling down) or ``half_open`` (one probe allowed)."""
        if self.failures < self.threshold:
            return "closed"
        return "open" if now < self.open_until or self.probing else "half_open"

    def allows(self, now: float) -> bool:
        """Whether a request may be sent to this server now."""
        return self.state(now) != "open"

    def on_start(self, now: float) -> None:
        """Record that a request starts; in the half-open state it becomes the probe."""
        if self.state(now) == "half_open":
            self.probing = True

    def on_success(self) -> None:
        """Record a success: the breaker closes."""
        self.failures = 0
        self.probing = False

    def on_failure(self, now: float) -> None:
        """Record a failure; at the threshold the breaker opens (cooldown doubles, at most 16x)."""
        self.failures += 1
        if self.failures >= self.threshold:
            doubling = min(self.failures - self.threshold, 4)
            self.open_until = now + self.cooldown_s * (2**doubling)
            if not self.probing:
                self.opened += 1
                log.warning("circuit breaker open (%d consecutive failures)", self.failures)
        self.probing = False


@dataclass
class Endpoint:
    """Live state of one server."""

    url: str
    breaker: CircuitBreaker
    model: str | None = None
    in_flight: int = 0
    completed: int = 0
    failed: int = 0
    tokens: int = 0
    bytes: int = 0
    latency_ewma_s: float = 0.0
    model_lock: asyncio.Lock = field(default_factory=asyncio.Lock)


# --------------------------------------------------------------------------- files


def _try_shared_lock(path: str) -> bool | None:
    """True if ``path`` exists and is not locked; False if locked; None if absent."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return True
    except OSError as e:
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            return False
        raise
    finally:
        os.close(fd)  # closing releases our shared lock


def all_finite(a: np.ndarray, dtype: str, chunk: int = 1 << 20) -> bool:
    """Whether every value of ``a`` (storage dtype) is finite; chunked to bound temporaries."""
    flat = a.reshape(-1)
    mask = _EXPONENT_MASKS.get(dtype)
    if mask is None:
        return all(np.isfinite(flat[i : i + chunk]).all() for i in range(0, flat.size, chunk))
    bits = flat.view(np.uint16)
    buf = np.empty(min(chunk, bits.size), dtype=np.uint16)
    for i in range(0, bits.size, chunk):
        part = bits[i : i + chunk]
        out = buf[: part.size]
        np.bitwise_and(part, mask, out=out)
        if out.size and out.max() == mask:
            return False
    return True


class _NotReady(Exception):
    """The file is missing or shorter than its header says (a writer may still be busy)."""


def read_hidden_states_file(path: str) -> tuple[np.ndarray, np.ndarray, str]:
    """Map a vLLM hidden-states safetensors file: ``(hidden_states, token_ids, dtype)``.

    The arrays are read-only views of a private mapping, so no bytes are copied in user space.

    Raises:
        _NotReady: the file is missing or truncated.
        protocol.ProtocolError: keys, dtypes or shapes are wrong.
    """
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        raise _NotReady("file does not exist") from None
    try:
        size = os.fstat(fd).st_size
        if size < 8:
            raise _NotReady(f"file has {size} bytes")
        with os.fdopen(os.dup(fd), "rb", buffering=0) as f:
            try:
                tensors = protocol.read_safetensors_header(f, size)
            except protocol.ProtocolError as e:
                if "truncated" in str(e) or "shorter" in str(e):
                    raise _NotReady(str(e)) from None
                raise
        for key in (protocol.HIDDEN_STATES_KEY, protocol.TOKEN_IDS_KEY):
            if key not in tensors:
                raise protocol.ProtocolError(f"file has no {key!r} tensor (has {sorted(tensors)})")
        hs, ti = tensors[protocol.HIDDEN_STATES_KEY], tensors[protocol.TOKEN_IDS_KEY]
        if hs.dtype not in STORAGE_DTYPES:
            raise protocol.ProtocolError(
                f"hidden_states dtype {hs.dtype} is not bfloat16, float16 or float32"
            )
        if ti.dtype != "int64":
            raise protocol.ProtocolError(f"token_ids dtype {ti.dtype} is not int64")
        if len(hs.shape) != 3 or len(ti.shape) != 1 or hs.shape[0] != ti.shape[0]:
            raise protocol.ProtocolError(
                f"shapes hidden_states {list(hs.shape)} / token_ids {list(ti.shape)} are not [T, layers, hidden] / [T]"
            )
        mm = mmap.mmap(
            fd, size, flags=mmap.MAP_PRIVATE | getattr(mmap, "MAP_POPULATE", 0), prot=mmap.PROT_READ
        )
    finally:
        os.close(fd)
    storage = np.dtype(STORAGE_DTYPES[hs.dtype])
    hidden = np.frombuffer(mm, dtype=storage, count=hs.nbytes // storage.itemsize, offset=hs.start)
    tokens = np.frombuffer(mm, dtype=np.int64, count=ti.shape[0], offset=ti.start)
    return hidden.reshape(hs.shape), tokens, hs.dtype


def remove_quietly(*paths: str) -> None:
    """Delete ``paths``; a missing file is fine and other errors are only logged."""
    for p in paths:
        try:
            os.unlink(p)
        except FileNotFoundError:
            pass
        except OSError as e:
            log.warning("could not remove %s: %s", p, e)


# --------------------------------------------------------------------------- client


class HiddenStateClient:
    """Async client for one process; share it between tasks. See the module docstring."""

    def __init__(self, config: ClientConfig):
        self.config = config
        self.endpoints = {
            url: Endpoint(url, CircuitBreaker(config.breaker_threshold, config.breaker_cooldown_s))
            for url in config.endpoints
        }
        self._session = None
        self._pool: ThreadPoolExecutor | None = None
        self._rr = 0
        self._shared_real = os.path.realpath(config.shared_dir)

    async def __aenter__(self) -> HiddenStateClient:
        import aiohttp

        limit = self.config.max_connections * len(self.endpoints)
        connector = aiohttp.TCPConnector(
            limit=limit, limit_per_host=self.config.max_connections, keepalive_timeout=60, ttl_dns_cache=300
        )
        timeout = aiohttp.ClientTimeout(
            total=self.config.request_timeout_s, sock_connect=self.config.connect_timeout_s
        )
        self._session = aiohttp.ClientSession(connector=connector, timeout=timeout, raise_for_status=False)
        self._pool = ThreadPoolExecutor(max(1, self.config.read_threads), thread_name_prefix="hsgen-read")
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    async def close(self) -> None:
        """Close connections and the read threads."""
        if self._session is not None:
            await self._session.close()
            self._session = None
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None

    @property
    def session(self):
        if self._session is None:
            raise RuntimeError("HiddenStateClient is not open: use 'async with HiddenStateClient(...)'")
        return self._session

    # ---------------------------------------------------------------- routing

    def healthy(self, url: str) -> bool:
        """Whether the endpoint's breaker lets requests through now."""
        return self.endpoints[url].breaker.allows(time.monotonic())

    async def _acquire(self, preferred: str | None) -> Endpoint:
        while True:
            now = time.monotonic()
            if preferred is not None and self.endpoints[preferred].breaker.allows(now):
                ep = self.endpoints[preferred]
            else:
                open_eps = [e for e in self.endpoints.values() if e.breaker.allows(now)]
                if not open_eps:
                    wake = min(e.breaker.open_until for e in self.endpoints.values())
                    await asyncio.sleep(max(0.01, min(wake - now, 1.0)))
                    continue
                self._rr += 1
                ep = min(
                    open_eps,
                    key=lambda e: (
                        e.in_flight,
                        (list(self.endpoints).index(e.url) - self._rr) % len(self.endpoints),
                    ),
                )
            ep.breaker.on_start(now)
            ep.in_flight += 1
            return ep

    # ---------------------------------------------------------------- HTTP

    def _headers(self, request_id: str | None = None) -> dict[str, str]:
        return protocol.auth_headers(self.config.api_key, request_id)

    async def model_of(self, url: str) -> str:
        """The model id to request from ``url`` (``config.model`` or its first ``/v1/models`` entry)."""
        if self.config.model:
            return self.config.model
        ep = self.endpoints[url]
        async with ep.model_lock:
            if ep.model is None:
                data = await self._get_json(url, "/v1/models")
                try:
                    ep.model = str(data["data"][0]["id"])
                except (KeyError, IndexError, TypeError):
                    raise FatalError(
                        "bad_models", f"{url}/v1/models returned no model: {data!r:.200}", url
                    ) from None
        return ep.model

    async def _get_json(self, url: str, path: str) -> Any:
        import aiohttp

        try:
            async with self.session.get(url + path, headers=self._headers()) as r:
                body = await r.read()
                self._check_status(url, r.status, body)
                return json.loads(body)
        except (TimeoutError, aiohttp.ClientError, OSError) as e:
            raise FetchError(
                "transport", f"GET {url}{path}: {type(e).__name__}: {e}", transient=True, endpoint=url
            ) from None
        except json.JSONDecodeError:
            raise FetchError(
                "bad_json", f"GET {url}{path} did not return JSON", transient=True, endpoint=url
            ) from None

    async def metrics(self, url: str, timeout_s: float = 2.0) -> dict[str, float] | None:
        """The server's Prometheus ``/metrics`` summed per family, or None when unavailable."""
        import aiohttp

        try:
            async with self.session.get(
                url + "/metrics", headers=self._headers(), timeout=aiohttp.ClientTimeout(total=timeout_s)
            ) as r:
                if r.status != 200:
                    return None
                return protocol.parse_prometheus(await r.text())
        except (TimeoutError, aiohttp.ClientError, OSError, UnicodeDecodeError):
            return None

    @staticmethod
    def _check_status(url: str, status: int, body: bytes) -> None:
        if status == 200:
            return
        try:
            message = json.loads(body)["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = body[:300].decode("utf-8", "replace")
        if status in (401, 403):
            raise FatalError(
                "unauthorized", f"{url} answered HTTP {status}: {message} (check --api-key)", url
            )
        transient = status in (408, 429) or status >= 500
        raise FetchError(f"http_{status}", f"{url}: {message}", transient=transient, endpoint=url)

    # ---------------------------------------------------------------- fetch

    async def fetch(self, prompt: RenderedPrompt, endpoint: str | None = None) -> FetchedSample:
        """Hidden states of one prompt, validated; the server's file and lock are removed.

        Args:
            prompt: token ids to send and the loss mask to attach.
            endpoint: try this server first (retries go to the least loaded healthy one).

        Raises:
            FetchError: after the retries, or at once for a non-transient failure.
            FatalError: for failures every request will hit (authentication, bad server).
        """
        if endpoint is not None and endpoint not in self.endpoints:
            endpoint = normalize_endpoint(endpoint)
            if endpoint not in self.endpoints:
                raise ValueError(f"unknown endpoint {endpoint}")
        t0 = time.monotonic()
        attempt = 0
        while True:
            attempt += 1
            ep = await self._acquire(endpoint if attempt == 1 else None)
            try:
                sample = await self._fetch_once(ep, prompt)
            except FetchError as e:
                e.attempts = attempt
                e.endpoint = e.endpoint or ep.url
                ep.failed += 1
                if e.transient:
                    ep.breaker.on_failure(time.monotonic())
                else:
                    ep.breaker.on_success()  # the server answered; the prompt is the problem
                if isinstance(e, FatalError) or not e.transient or attempt > self.config.max_retries:
                    raise
                delay = min(self.config.backoff_max_s, self.config.backoff_s * 2 ** (attempt - 1))
                delay *= 0.5 + random.random()
                log.info("retrying %s in %.2fs after %s", prompt.sample_id, delay, e)
                await asyncio.sleep(delay)
                continue
            except BaseException:
                ep.breaker.probing = False
                raise
            finally:
                ep.in_flight -= 1
            ep.breaker.on_success()
            ep.completed += 1
            ep.tokens += sample.num_tokens
            ep.bytes += sample.nbytes
            sample.latency_s = time.monotonic() - t0
            sample.attempts = attempt
            ep.latency_ewma_s = (
                sample.latency_s if ep.completed == 1 else 0.9 * ep.latency_ewma_s + 0.1 * sample.latency_s
            )
            return sample

    async def _fetch_once(self, ep: Endpoint, prompt: RenderedPrompt) -> FetchedSample:
        import aiohttp

        url = ep.url
        model = await self.model_of(url)
        body = protocol.completion_request(
            model, prompt.token_ids, include_output_tokens=self.config.include_output_tokens
        )
        request_id = "hsgen-" + uuid.uuid4().hex[:16]
        try:
            async with self.session.post(
                url + "/v1/completions", data=json.dumps(body), headers=self._headers(request_id)
            ) as r:
                raw = await r.read()
                status = r.status
        except TimeoutError:
            raise FetchError(
                "timeout",
                f"{url}: no response within {self.config.request_timeout_s}s",
                transient=True,
                endpoint=url,
            ) from None
        except (aiohttp.ClientError, OSError) as e:
            raise FetchError(
                "transport", f"{url}: {type(e).__name__}: {e}", transient=True, endpoint=url
            ) from None
        self._check_status(url, status, raw)
        try:
            result = protocol.parse_extraction_response(json.loads(raw))
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise FetchError(
                "bad_json", f"{url}: response is not JSON", transient=True, endpoint=url
            ) from None
        except protocol.ProtocolError as e:
            raise FatalError("protocol", f"{url}: {e}", url) from None
        path = result.hidden_states_path
        if not os.path.isabs(path) or not protocol.is_within(path, self._shared_real):
            raise FetchError(
                "path_outside_shared_dir",
                f"{url} named {path!r}, outside the shared directory {self.config.shared_dir!r} "
                "(set --shared-dir to the servers' shared_storage_path as seen from here); file left alone",
                transient=False,
                endpoint=url,
            )
        lock = protocol.lock_path(path)
        try:
            if list(result.prompt_token_ids) != list(prompt.token_ids):
                raise FetchError(
                    "prompt_mismatch",
                    f"{url} echoed {len(result.prompt_token_ids)} prompt ids that differ from the "
                    f"{len(prompt.token_ids)} sent",
                    transient=False,
                    endpoint=url,
                )
            hidden, _tokens, dtype = await self._wait_and_read(path, lock, prompt, url)
        finally:
            if self.config.delete_files:
                remove_quietly(path, lock)
        return FetchedSample(
            sample_id=prompt.sample_id,
            hidden_states=hidden,
            token_ids=np.asarray(prompt.token_ids, dtype=np.int64),
            loss_mask=np.asarray(prompt.loss_mask, dtype=np.uint8),
            dtype=dtype,
            endpoint=url,
        )

    async def _wait_and_read(self, path: str, lock: str, prompt: RenderedPrompt, url: str):
        cfg = self.config
        loop = asyncio.get_running_loop()
        start = time.monotonic()
        appear_deadline = start + cfg.file_wait_s
        lock_deadline: float | None = None
        settle_deadline: float | None = None
        delay = 0.0005
        last_reason = "file did not appear"
        while True:
            now = time.monotonic()
            state = _try_shared_lock(lock)
            if state is False:  # a writer holds it
                lock_deadline = lock_deadline or now + cfg.lock_timeout_s
                settle_deadline = None
                if now > lock_deadline:
                    raise FetchError(
                        "lock_timeout",
                        f"{lock} still locked after {cfg.lock_timeout_s}s (writer stuck or stale lock)",
                        transient=True,
                        endpoint=url,
                    )
            else:
                try:
                    return await loop.run_in_executor(self._pool, self._read_validate, path, prompt)
                except _NotReady as e:
                    last_reason = str(e)
                    if state is True or os.path.exists(path):
                        settle_deadline = settle_deadline or now + cfg.settle_s
                        if now > settle_deadline:
                            kind = "missing_file" if not os.path.exists(path) else "truncated_file"
                            raise FetchError(
                                kind,
                                f"{path}: {last_reason} after the writer finished",
                                transient=True,
                                endpoint=url,
                            ) from None
                    elif now > appear_deadline:
                        raise FetchError(
                            "missing_file",
                            f"{path}: neither the file nor its lock appeared within {cfg.file_wait_s}s",
                            transient=True,
                            endpoint=url,
                        ) from None
            await asyncio.sleep(delay)
            delay = min(delay * 1.5, 0.02)

    def _read_validate(self, path: str, prompt: RenderedPrompt) -> tuple[np.ndarray, np.ndarray, str]:
        try:
            hidden, tokens, dtype = read_hidden_states_file(path)
        except protocol.ProtocolError as e:
            raise FetchError("bad_file", f"{path}: {e}", transient=True) from None
        n = len(prompt.token_ids)
        t = tokens.shape[0]
        if t < n or (t != n and not self.config.include_output_tokens):
            raise FetchError(
                "token_mismatch", f"{path}: file has {t} tokens but {n} were sent", transient=False
            )
        sent = np.asarray(prompt.token_ids, dtype=np.int64)
        if not np.array_equal(tokens[:n], sent):
            bad = int(np.argmax(tokens[:n] != sent))
            raise FetchError(
                "token_mismatch",
                f"{path}: token_ids differ from those sent at position {bad} "
                f"({int(tokens[bad])} != {int(sent[bad])})",
                transient=False,
            )
        hidden = hidden[:n]
        if self.config.check_finite and not all_finite(hidden, dtype):
            raise FetchError("non_finite", f"{path}: hidden states contain NaN or Inf", transient=False)
        return hidden, tokens[:n], dtype

    def stats(self) -> dict[str, dict[str, Any]]:
        """Per-endpoint counters: in flight, completed, failed, tokens, bytes, breaker state."""
        now = time.monotonic()
        return {
            url: {
                "in_flight": e.in_flight,
                "completed": e.completed,
                "failed": e.failed,
                "tokens": e.tokens,
                "bytes": e.bytes,
                "breaker": e.breaker.state(now),
                "breaker_opened": e.breaker.opened,
            }
            for url, e in self.endpoints.items()
        }


__all__ = [
    "CircuitBreaker",
    "ClientConfig",
    "FatalError",
    "FetchError",
    "FetchedSample",
    "HiddenStateClient",
    "all_finite",
    "normalize_endpoint",
    "read_hidden_states_file",
]
