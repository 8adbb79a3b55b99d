"""The request side of an online run, on its own asyncio thread: prompt -> request -> file.

The same pipeline as ``hsgen generate``: prompts rendered by :class:`hsgen.inputs.render.ChatRenderer`,
requests through :class:`hsgen.client.fetch.HiddenStateClient` paced by :class:`hsgen.client.saturate.Saturator`
(requests in flight follow each server's queue), each validated sample handed to the
:class:`~spectrain.online.landing.Lander`. What to request comes from the ledger: the samples of
the window ahead of the trainer that are nowhere yet, within the scratch bound.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Executor, ThreadPoolExecutor
from typing import Any

from spectrain.online.config import OnlineConfig
from spectrain.online.landing import HeaderProblem, Lander
from spectrain.online.ledger import SampleLedger
from spectrain.online.metrics import OnlineMetrics
from spectrain.online.prompts import PromptSet
from spectrain.online.stores import OnlineStores

log = logging.getLogger(__name__)


class Fetcher:
    """Keeps the servers busy with the samples the trainer will need next (see the module docstring).

    Args:
        client_factory: builds the async client (``HiddenStateClient`` from the config by default).
        request_prefix: the default client's ``X-Request-Id`` prefix (the run's, see
            :mod:`~spectrain.online.run_lease`).
        heartbeat: called on every turn of the fetch loop (keeps the run's lease fresh).
        first_ids: this rank's ids in training order before an epoch has started (the header probe
            fetches the first of them, so its sample gets trained).
        open_scratch: opens the scratch store once the first fetched sample gave the header (I/O thread).
    """

    def __init__(self, config: OnlineConfig, prompts: PromptSet, stores: OnlineStores, ledger: SampleLedger,
                 lander: Lander, metrics: OnlineMetrics, io: Executor, *, client_factory: Callable[[], Any] | None,
                 first_ids: Callable[[], list[str]], open_scratch: Callable[[], None],
                 request_prefix: str | None = None, heartbeat: Callable[[], None] = lambda: None):  # fmt: skip
        self.config = config
        self.prompts = prompts
        self.stores = stores
        self.ledger = ledger
        self.lander = lander
        self.metrics = metrics
        self.io = io
        self.client_factory = client_factory or self._default_client
        self.first_ids = first_ids
        self.open_scratch = open_scratch
        self.request_prefix = request_prefix
        self.heartbeat = heartbeat
        self.client_prefix: str | None = None
        """The prefix of the requests the client sent (its leftovers carry it)."""
        self._rendered: dict[str, Any] = {}
        self._render_pool = ThreadPoolExecutor(1, thread_name_prefix="online-render")
        self._probe_lock: asyncio.Lock | None = None
        self._client = None
        self._sat = None
        self._loop = asyncio.new_event_loop()
        self._wake: asyncio.Event | None = None
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._thread_main, name="online-fetch", daemon=True)
        ledger.wake = self.wake

    def start(self) -> None:
        self._thread.start()
        self._started.wait()

    def stop(self) -> None:
        """Stop requesting (the ledger is closed first); waits up to 60 s for the thread."""
        self.wake()
        self._thread.join(timeout=60)
        if self._thread.is_alive():
            log.warning("the online fetch thread did not stop within 60 s")
        self._render_pool.shutdown(wait=True)

    def _default_client(self):
        from hsgen.client.fetch import ClientConfig, HiddenStateClient

        opts = dict(self.config.client_options)
        opts.setdefault("endpoints", list(self.config.endpoints))
        opts.setdefault("shared_dir", self.config.shared_dir)
        if self.config.api_key is not None:
            opts.setdefault("api_key", self.config.api_key)
        if self.request_prefix is not None:
            opts.setdefault("request_prefix", self.request_prefix)
        # every file is checked on its header against what the run expects, before it is read: the
        # store's header, or a new store's shape as hsgen generate has it (layer ids, the model's config)
        from hsgen.generate.sink import expected_of
        from hsgen.generate.store_shape import StoreShape

        if self.stores.store is not None:
            expected = expected_of(self.stores.store)
        else:
            expected = StoreShape.named(self.config.layer_ids or (), verifier=self.config.verifier).expected()
        opts.setdefault("expected", expected)
        if self.config.reads_once:  # read once into the batch, from the file, checked as it lands
            opts.setdefault("check_finite", False)
            opts.setdefault("rows_in_file", True)
        return HiddenStateClient(ClientConfig(**opts))

    def wake(self) -> None:
        """Run the fetch loop's next step now (any thread)."""
        wake = self._wake
        if wake is not None and not self._loop.is_closed():
            with contextlib.suppress(RuntimeError):
                self._loop.call_soon_threadsafe(wake.set)

    def probe_header(self) -> None:
        """Learn the header from the first samples (blocking; for a run whose store does not exist yet).

        Raises ``RuntimeError`` when the fetch thread stops for good meanwhile (a dead endpoint, a
        wrong setting), instead of waiting forever.
        """
        ledger = self.ledger
        if ledger.fatal is None:
            fut = asyncio.run_coroutine_threadsafe(self._probe_header(), self._loop)
            while ledger.fatal is None:
                try:
                    fut.result(timeout=0.2)
                    break
                except concurrent.futures.TimeoutError:
                    continue
                except concurrent.futures.CancelledError:  # the fetch thread ended: fatal says why
                    break
        if ledger.fatal is not None:
            raise RuntimeError(f"online data source failed: {ledger.fatal}") from ledger.fatal

    # ------------------------------------------------------------------ the loop

    def _thread_main(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self._run())
        finally:
            pending = asyncio.all_tasks(
                self._loop
            )  # e.g. a header probe waiting for a client that never came
            for t in pending:
                t.cancel()
            if pending:
                self._loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            self._loop.close()

    async def _run(self) -> None:
        self._wake = asyncio.Event()
        self._started.set()
        tasks: set[asyncio.Task] = set()
        try:
            async with self.client_factory() as client:
                self.client_prefix = getattr(client, "request_prefix", None)
                from hsgen.client.saturate import SaturationConfig, Saturator

                probe = getattr(client, "probe", None)
                if probe is not None:  # a dead or wrong endpoint fails here, in seconds
                    await probe()
                self._sat = Saturator(SaturationConfig(**self.config.saturation), list(client.endpoints),
                                      client.metrics, client.healthy)  # fmt: skip
                await self._sat.start()
                self._client = client
                try:
                    await self._loop_until_closed(tasks)
                finally:  # stop the requests before the client's session closes
                    for t in tasks:
                        t.cancel()
                    if tasks:
                        await asyncio.wait(set(tasks), timeout=10)
                    await self._sat.stop()
        except Exception as e:
            from hsgen.client.fetch import FatalError

            if isinstance(e, FatalError):  # a setting or a server: get() and header say it, once
                log.debug("the hidden-state client stopped: %s", e)
            else:
                log.exception("the hidden-state client failed")
            self.ledger.set_fatal(e)

    async def _loop_until_closed(self, tasks: set[asyncio.Task]) -> None:
        assert self._wake is not None
        while not self.ledger.closed:
            self._wake.clear()
            self.heartbeat()
            try:
                await self._step(tasks)
            except Exception as e:  # a bug or a fatal setting: surface it in get()
                log.exception("online fetch loop failed")
                self.ledger.set_fatal(e)
                return
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout=self.config.flush_interval_s)

    async def _probe_header(self) -> None:
        """Fetch the first planned samples until one succeeds, to learn hidden size and dtype of a new store."""
        if self._probe_lock is None:
            self._probe_lock = asyncio.Lock()
        async with self._probe_lock:
            if self.stores.header is not None:
                return
            while self._client is None:
                if self.ledger.fatal is not None:
                    raise RuntimeError(
                        f"online data source failed: {self.ledger.fatal}"
                    ) from self.ledger.fatal
                await asyncio.sleep(0.01)
            with self.ledger.lock:
                ep = self.ledger.epoch
                order = ep.ids[ep.cursor :] if ep is not None and ep.started else None
            order = order if order is not None else self.first_ids()
            from hsgen.client.fetch import FatalError
            from hsgen.inputs.render import RenderError

            last: Exception | None = None
            for sid in order[:8]:
                try:
                    prompt = self.prompts.render(sid)
                    fetched = await self._client.fetch(prompt)
                except (
                    FatalError
                ) as e:  # a setting or the servers (all down, wrong shape): no sample can succeed
                    self.ledger.set_fatal(e)
                    return
                except (RenderError, Exception) as e:  # noqa: B014 - this sample's: report and try the next one
                    last = e
                    self.ledger.fail(sid, f"{type(e).__name__}: {e}")
                    continue
                hs = fetched.hidden_states
                self.stores.header = self.stores.make_header(
                    int(hs.shape[2]), int(hs.shape[1]), str(fetched.dtype)
                )
                await asyncio.get_running_loop().run_in_executor(self.io, self.open_scratch)
                await self.lander.land(sid, fetched)
                await self.lander.flush()
                return
            raise RuntimeError(
                f"the first {len(order[:8])} samples could not be fetched; last error: {last}"
            ) from last

    async def _step(self, tasks: set[asyncio.Task]) -> None:
        loop = asyncio.get_running_loop()
        ledger = self.ledger
        if ledger.fatal is not None:
            return
        if self.stores.header is None:
            with ledger.lock:
                active = ledger.epoch is not None and ledger.epoch.started
            if active:
                await self._probe_header()
            return
        now = time.monotonic()
        stale = now - self.stores.last_refresh >= self.config.store_refresh_s
        if (
            self.stores.store is not None
            and stale
            and await loop.run_in_executor(self.io, self.stores.refresh_main)
        ):
            ledger.notify()
        todo = ledger.window_missing()
        if len(self._rendered) > 2 * self.config.prefetch_samples:
            keep = set(todo)
            for sid in [k for k in self._rendered if k not in keep]:
                del self._rendered[sid]
        need_render = [sid for sid in todo if sid not in self._rendered][:64]
        if need_render:
            await loop.run_in_executor(self._render_pool, self._render_many, need_render)
        for sid, _reserved, overshoot in ledger.schedule(self._rendered, self.stores.bytes_for):
            prompt = self._rendered.pop(sid)
            if overshoot:
                self.metrics.overshoots += 1
            t = asyncio.create_task(self._fetch(sid, prompt))
            tasks.add(t)
            t.add_done_callback(tasks.discard)
        if self.lander.should_flush():
            await self.lander.flush()

    def _render_many(self, ids: list[str]) -> None:
        from hsgen.inputs.render import RenderError

        for sid in ids:
            try:
                self._rendered[sid] = self.prompts.render(sid)
            except RenderError as e:
                self.ledger.fail(sid, f"render: {e}")

    async def _fetch(self, sid: str, prompt) -> None:
        assert self._sat is not None and self._client is not None
        ledger = self.ledger
        url = await self._sat.acquire()
        t0 = time.monotonic()
        ok = False
        try:
            fetched = await self._client.fetch(prompt, endpoint=url)
            ok = True
        except asyncio.CancelledError:
            raise
        except Exception as e:
            from hsgen.client.fetch import FatalError

            with ledger.cond:  # one critical section (the lock is re-entrant): no refetch in between
                ledger.inflight.pop(sid, None)
                if isinstance(e, FatalError):  # no other prompt can succeed either (API key, server setup)
                    ledger.set_fatal(e)
                    return
            ledger.fail(sid, f"{type(e).__name__}: {e}")
            return
        finally:
            await self._sat.release(url, latency_s=time.monotonic() - t0, tokens=len(prompt.token_ids), ok=ok)
        try:
            await self.lander.land(sid, fetched)
        except Exception as e:
            ledger.drop_inflight(sid)
            if isinstance(e, HeaderProblem):
                ledger.set_fatal(e)
                return
            ledger.fail(sid, f"store: {type(e).__name__}: {e}")
            return
        if sid in ledger.waiting:
            self.wake()
