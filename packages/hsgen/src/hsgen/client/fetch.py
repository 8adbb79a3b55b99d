"""Fetch one prompt's hidden states from vLLM servers, validated, with the server's files removed.

``HiddenStateClient`` speaks vLLM's extraction protocol (``docs/serve.md``,
``hsgen.protocol.extraction``): one ``POST /v1/completions`` per prompt with its token ids, then the file
step (:mod:`hsgen.client.hidden_file`): wait for the ``.lock`` (vLLM >= 0.22) or for the file to
appear (0.24+ may write it after the response), read the safetensors file, validate it, and
delete the file and its lock, all without following a link (:mod:`hsgen.client.shared_dir`).

Several endpoints are used at once; each request goes to the least loaded healthy one. Only
transient errors are retried (transport errors, timeouts, HTTP 408/429/5xx, a file missing,
truncated or still locked after the wait), with exponential backoff (:mod:`hsgen.client.retry`, on
tenacity); a circuit breaker per endpoint stops sending to a server after consecutive failures
and probes it again later. :meth:`HiddenStateClient.probe` checks every endpoint before work
starts; a 401/403, a file named outside the shared directory, or every endpoint silent for
``max_down_s`` are fatal. :meth:`HiddenStateClient.stop_retrying` ends every fetch that is
waiting to retry or for a server (:class:`~hsgen.client.errors.FetchStopped`), not those in a request.

Usage::

    async with HiddenStateClient(ClientConfig(endpoints=["http://gpu1:8000"], shared_dir="/dev/shm/hs")) as c:
        await c.probe()
        sample = await c.fetch(rendered_prompt)
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from hsgen.client import retry
from hsgen.client.breaker import CircuitBreaker, Endpoint
from hsgen.client.config import ClientConfig, FetchedSample, normalize_endpoint
from hsgen.client.errors import FatalError, FetchError, FetchStopped, describe_transport
from hsgen.client.hidden_file import (
    STORAGE_DTYPES,
    ExpectedStates,
    FileWait,
    HiddenFileReader,
    all_finite,
    read_hidden_states_file,
    remove_misplaced,
)
from hsgen.client.phases import PhaseTimes
from hsgen.client.shared_dir import SharedDir, UnsafePath
from hsgen.protocol import extraction as protocol
from hsgen.protocol.prompt import RenderedPrompt
from hsgen.protocol.prompt_logprobs import parse_target_ids

log = logging.getLogger(__name__)

PROMPT_LOGPROBS = 1
"""Top-k asked for with ``targets = "argmax"``: the top token is all the hard targets need."""


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
        self.shared = SharedDir(config.shared_dir)
        self._files: HiddenFileReader | None = None
        self._last_alive = time.monotonic()
        self._last_down_error = ""
        self._stopping = asyncio.Event()
        self._waiting: set[asyncio.Task] = set()
        """Tasks waiting for a completion's answer (the ``--max-down`` watchdog's charges)."""
        self._cut_off: set[asyncio.Task] = set()
        self._watchdog: asyncio.Task | None = None
        self.phases: PhaseTimes | None = None  # the file step's seconds (``validate``)

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
        c = self.config
        wait = FileWait(
            c.file_wait_s,
            c.lock_timeout_s,
            c.settle_s,
            c.check_finite,
            c.include_output_tokens,
            c.map_files,
            c.rows_in_file,
            (c.expected or ExpectedStates()).merged(c.expect_layers, c.expect_hidden_size, c.expect_dtype),
        )
        self._files = HiddenFileReader(self.shared, wait, self._pool, self.phases)
        self._last_alive = time.monotonic()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    async def close(self) -> None:
        """Close connections and the read threads."""
        if self._watchdog is not None and not self._watchdog.done():
            self._watchdog.cancel()
        if self._session is not None:
            await self._session.close()
            self._session = None
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
        self.shared.close()

    def expect(self, expected: ExpectedStates) -> None:
        """Check every later file's header against ``expected`` (the config's own figures win)."""
        c = self.config
        merged = expected.merged(c.expect_layers, c.expect_hidden_size, c.expect_dtype)
        self.config = dataclasses.replace(c, expected=merged)
        if self._files is not None:
            self._files.wait = dataclasses.replace(self._files.wait, expect=merged)

    @property
    def request_prefix(self) -> str:
        """The start of every ``X-Request-Id`` this client sends (and of the files they cause)."""
        return self.config.request_prefix

    def remove_own_files(self) -> int:
        """Remove this client's files and locks left in the shared directory; returns how many.

        Call it when no request of this client is in flight any more (a cancelled request's file
        may still appear later: the next run's cleanup or ``hsgen gc --shared-dir`` takes it).
        """
        return self.shared.remove_owned(self.request_prefix)

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
                    self._check_down()
                    wake = min(e.breaker.open_until for e in self.endpoints.values())
                    await self._pause(max(0.01, min(wake - now, 1.0)))
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

    async def probe(self) -> dict[str, str]:
        """Check every endpoint before work starts; returns ``{url: model id}`` of those that answer.

        Each endpoint gets one ``GET /v1/models`` (at most ``probe_timeout_s``); the shared
        directory must exist. Endpoints that do not answer are logged and left to the breaker
        when at least one answers.

        Raises:
            FatalError: no endpoint answers (the message names each URL and its cause), one
                answers 401/403 (bad API key) or lists no model, or the shared directory is
                missing here.
        """
        results = await asyncio.gather(
            *(self._probe_one(url) for url in self.endpoints), return_exceptions=True
        )
        up: dict[str, str] = {}
        down: dict[str, str] = {}
        for url, res in zip(self.endpoints, results, strict=True):
            if isinstance(res, FatalError):
                raise res
            if isinstance(res, BaseException):
                down[url] = res.message if isinstance(res, FetchError) else f"{type(res).__name__}: {res}"
            else:
                up[url] = res
        if not up:
            causes = "; ".join(f"{url}: {why}" for url, why in down.items())
            raise FatalError("unreachable", f"no server answers GET /v1/models ({causes})")
        for url, why in down.items():
            log.warning("%s does not answer (%s): going on with the other servers", url, why)
            self.endpoints[url].breaker.on_failure(time.monotonic())
        try:
            self.shared.fd()
        except OSError as e:
            raise FatalError(
                "shared_dir",
                f"--shared-dir {self.config.shared_dir}: {e.strerror} (it must be the servers' "
                "shared_storage_path as seen from this machine)",
            ) from None
        self._last_alive = time.monotonic()
        return up

    async def _probe_one(self, url: str) -> str:
        import aiohttp

        path = protocol.MODELS_PATH
        timeout = aiohttp.ClientTimeout(total=self.config.probe_timeout_s)
        try:
            async with self.session.get(url + path, headers=self._headers(), timeout=timeout) as r:
                body = await r.read()
                status = r.status
        except (TimeoutError, aiohttp.ClientError, OSError) as e:
            raise FetchError(
                "transport", describe_transport(e, self.config.probe_timeout_s), transient=True
            ) from None
        self._check_status(url, status, body)
        try:
            served = protocol.served_model_ids(body)
        except protocol.ProtocolError:
            raise FatalError("bad_models", f"{url}{path} returned no model: {body[:200]!r}", url) from None
        model = served[0]
        if self.config.model and self.config.model not in served:
            raise FatalError(
                "bad_model",
                f"--model {self.config.model}: {url} serves {served} (here --model is the served model id "
                "to request; leave it out to use the server's first)",
                url,
            )
        ep = self.endpoints[url]
        if ep.model is None:
            ep.model = model
        return self.config.model or model

    def _check_down(self) -> None:
        """Raise :class:`FatalError` once no endpoint has answered for ``max_down_s``."""
        limit = self.config.max_down_s
        down_for = time.monotonic() - self._last_alive
        if limit and down_for > limit:
            last = f" (last error: {self._last_down_error})" if self._last_down_error else ""
            raise FatalError(
                "endpoints_down",
                f"no server has answered for {down_for:.0f} s (--max-down {limit:g}){last}",
            )

    async def model_of(self, url: str) -> str:
        """The model id to request from ``url`` (``config.model`` or its first ``/v1/models`` entry)."""
        if self.config.model:
            return self.config.model
        ep = self.endpoints[url]
        async with ep.model_lock:
            if ep.model is None:
                data = await self._get_json(url, protocol.MODELS_PATH)
                try:
                    ep.model = protocol.served_model_ids(data)[0]
                except protocol.ProtocolError:
                    raise FatalError(
                        "bad_models", f"{url}{protocol.MODELS_PATH} returned no model: {data!r:.200}", url
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
                "transport",
                f"GET {url}{path}: {describe_transport(e, self.config.request_timeout_s)}",
                transient=True,
                endpoint=url,
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

    def _check_status(self, url: str, status: int, body: bytes) -> None:
        self._last_alive = time.monotonic()
        if status == 200:
            return
        try:
            message = json.loads(body)["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = body[:300].decode("utf-8", "replace")
        if status in (401, 403):
            raise FatalError(
                "unauthorized",
                f"{url} answered HTTP {status}: {message} (check --api-key or $VLLM_API_KEY)",
                url,
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
            FetchStopped: :meth:`stop_retrying` was called and this fetch would retry or wait.
        """
        if endpoint is not None and endpoint not in self.endpoints:
            endpoint = normalize_endpoint(endpoint)
            if endpoint not in self.endpoints:
                raise ValueError(f"unknown endpoint {endpoint}")
        t0 = time.monotonic()
        c = self.config
        policy = retry.retrying(
            c.max_retries, c.backoff_s, c.backoff_max_s, sleep=self._pause, label=prompt.sample_id
        )
        async for trial in policy:
            with trial:
                attempt = trial.retry_state.attempt_number
                sample = await self._attempt(prompt, endpoint if attempt == 1 else None, attempt, t0)
        return sample

    async def _attempt(
        self, prompt: RenderedPrompt, preferred: str | None, attempt: int, t0: float
    ) -> FetchedSample:
        """One request and its file on the least loaded healthy endpoint; counters and breaker updated.

        ``t0`` is when the fetch began: the sample's latency counts its earlier attempts.
        """
        if attempt > 1 and self._stopping.is_set():
            raise FetchStopped()
        ep = await self._acquire(preferred)
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
            if e.reason in ("transport", "timeout"):
                self._last_down_error = f"{e.endpoint}: {e.message}"
                self._check_down()
            raise
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

    async def _pause(self, seconds: float) -> None:
        """Sleep ``seconds`` (a retry's backoff, a wait for a server); FetchStopped once stopping."""
        if not self._stopping.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), seconds)
        if self._stopping.is_set():
            raise FetchStopped()

    def stop_retrying(self) -> None:
        """No more retries or waits: fetches that would retry or wait for a server end with FetchStopped.

        Requests already sent go on (cancel their tasks to end them sooner), and so does the first
        attempt of a fetch while a server is available.
        """
        self._stopping.set()

    async def _fetch_once(self, ep: Endpoint, prompt: RenderedPrompt) -> FetchedSample:
        url = ep.url
        model = await self.model_of(url)
        request_id = self.request_prefix + uuid.uuid4().hex[:16]
        result = await self._post_completion(url, model, prompt, request_id)
        path = result.hidden_states_path
        try:
            parts = self.shared.relative(path)
        except UnsafePath:
            if self.config.delete_files:
                await remove_misplaced(path, request_id, min(self.config.file_wait_s, 10.0))
            raise FatalError(
                "path_outside_shared_dir",
                f"{url} wrote {path!r}, outside the shared directory {self.config.shared_dir!r}: set --shared-dir "
                "to the servers' shared_storage_path as seen from this machine",
                url,
            ) from None
        assert self._files is not None
        try:
            if list(result.prompt_token_ids) != list(prompt.token_ids):
                raise FetchError(
                    "prompt_mismatch",
                    f"{url} echoed {len(result.prompt_token_ids)} prompt ids that differ from the "
                    f"{len(prompt.token_ids)} sent",
                    transient=False,
                    endpoint=url,
                )
            targets = self._targets(result, url)
            hidden, _tokens, dtype = await self._files.wait_and_read(parts, prompt, url)
        except UnsafePath as e:
            log.warning("refusing %s: %s", path, e)
            raise FetchError("unsafe_path", f"{path}: {e}", transient=False, endpoint=url) from None
        finally:
            if self.config.delete_files:
                self._files.remove(parts)
        return FetchedSample(
            sample_id=prompt.sample_id,
            hidden_states=hidden,
            token_ids=np.asarray(prompt.token_ids, dtype=np.int64),
            loss_mask=np.asarray(prompt.loss_mask, dtype=np.uint8),
            dtype=dtype,
            endpoint=url,
            target_ids=targets,
            source=prompt.source,
        )

    def _targets(self, result: protocol.ExtractionResult, url: str) -> np.ndarray | None:
        """The verifier's greedy targets of a response (``targets = "argmax"``), checked."""
        if self.config.targets != "argmax":
            return None
        if result.prompt_logprobs is None:
            raise FatalError(
                "no_prompt_logprobs",
                f"{url} ignored prompt_logprobs: --targets argmax needs a server that returns them (vLLM does)",
                url,
            )
        try:
            return np.asarray(parse_target_ids(result, PROMPT_LOGPROBS), dtype=np.int32)
        except protocol.ProtocolError as e:
            raise FetchError("bad_targets", f"{url}: {e}", transient=False, endpoint=url) from None

    async def _send(self, url: str, body: str, request_id: str) -> tuple[bytes, int]:
        async with self.session.post(
            url + "/v1/completions", data=body, headers=self._headers(request_id)
        ) as r:
            return await r.read(), r.status

    async def _send_watched(self, url: str, body: str, request_id: str) -> tuple[bytes, int]:
        """:meth:`_send`, ended by :class:`FatalError` ``endpoints_down`` as soon as no server has
        answered anything for ``max_down_s`` while it waits (a server that takes requests and never
        answers them ends a run after ``--max-down``, not after ``--timeout``).

        One watchdog task per client checks every waiting request at once; a request only joins
        a set while it waits, so the request path gains no task, timer or wake-up of its own.
        """
        if not self.config.max_down_s:
            return await self._send(url, body, request_id)
        task = asyncio.current_task()
        assert task is not None
        self._waiting.add(task)
        if self._watchdog is None or self._watchdog.done():
            self._watchdog = asyncio.ensure_future(self._watch_down(self.config.max_down_s))
        try:
            return await self._send(url, body, request_id)
        except asyncio.CancelledError:
            if task not in self._cut_off:
                raise
            self._cut_off.discard(task)
            if task.uncancel() > 0:  # cancelled by someone else too: that cancellation wins
                raise
            self._last_down_error = f"{url}: POST /v1/completions unanswered"
            self._check_down()
            raise
        finally:
            self._waiting.discard(task)

    async def _watch_down(self, limit: float) -> None:
        """Cut off every waiting request once no server has answered for ``limit`` seconds."""
        tick = max(0.05, min(1.0, limit / 4))
        while self._waiting:
            await asyncio.sleep(tick)
            if time.monotonic() - self._last_alive > limit:
                for t in list(self._waiting):
                    if t not in self._cut_off:
                        self._cut_off.add(t)
                        t.cancel()

    async def _post_completion(
        self, url: str, model: str, prompt: RenderedPrompt, request_id: str
    ) -> protocol.ExtractionResult:
        """The request step: ``POST /v1/completions`` and its parsed response."""
        import aiohttp

        body = protocol.completion_request(
            model,
            prompt.token_ids,
            include_output_tokens=self.config.include_output_tokens,
            prompt_logprobs=PROMPT_LOGPROBS if self.config.targets == "argmax" else None,
        )
        try:
            raw, status = await self._send_watched(url, json.dumps(body), request_id)
        except TimeoutError:
            raise FetchError(
                "timeout",
                f"{url}: no response within {self.config.request_timeout_s}s",
                transient=True,
                endpoint=url,
            ) from None
        except (aiohttp.ClientError, OSError) as e:
            raise FetchError(
                "transport",
                f"{url}: {describe_transport(e, self.config.request_timeout_s)}",
                transient=True,
                endpoint=url,
            ) from None
        self._check_status(url, status, raw)
        try:
            return protocol.parse_extraction_response(json.loads(raw))
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise FetchError(
                "bad_json", f"{url}: response is not JSON", transient=True, endpoint=url
            ) from None
        except protocol.ProtocolError as e:
            raise FatalError("protocol", f"{url}: {e}", url) from None

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
    "STORAGE_DTYPES",
    "CircuitBreaker",
    "ClientConfig",
    "FatalError",
    "FetchError",
    "FetchStopped",
    "FetchedSample",
    "HiddenStateClient",
    "all_finite",
    "normalize_endpoint",
    "read_hidden_states_file",
]
