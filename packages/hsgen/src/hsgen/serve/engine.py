"""Continuous batching over a :class:`~hsgen.serve.hidden.HiddenStateExtractor`.

Requests wait in a FIFO queue. Each step the scheduler keeps every running sequence and
admits waiting ones while the step stays within ``max_num_seqs`` sequences and
``max_num_batched_tokens`` padded tokens (a longer single prompt runs alone), then runs one
forward for all of them in a worker thread, so the event loop stays responsive. A sequence
that still has tokens to generate stays running and is recomputed next step (no KV cache:
prompts here are extracted with ``max_tokens=1``).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from hsgen.serve.capacity import CapacityModel
from hsgen.serve.hidden import HiddenStateExtractor, PromptLogprobs

log = logging.getLogger(__name__)


@dataclass
class EngineResult:
    """A finished sequence.

    Attributes:
        output_token_ids: generated tokens (greedy).
        finish_reason: ``"length"`` or ``"stop"`` (an EOS token was generated).
        hidden_states: ``[T, n_layers, H]`` for ``hidden_token_ids``, model dtype, CPU.
        hidden_token_ids: the prompt, or with ``include_output_tokens`` all tokens but the last.
        prompt_logprobs: the prompt's top-k per position, when the request asked for them.
    """

    output_token_ids: list[int]
    finish_reason: str
    hidden_states: torch.Tensor
    hidden_token_ids: list[int]
    prompt_logprobs: PromptLogprobs | None = None


@dataclass(eq=False)
class EngineRequest:
    """One sequence to run: prompt, generation limits and its future."""

    prompt_token_ids: list[int]
    max_tokens: int = 1
    ignore_eos: bool = False
    include_output_tokens: bool = False
    prompt_logprobs: int | None = None
    future: asyncio.Future | None = None
    output_token_ids: list[int] = field(default_factory=list)
    prompt_hidden: torch.Tensor | None = None
    prompt_logprobs_out: PromptLogprobs | None = None

    @property
    def tokens(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids


@dataclass
class EngineStats:
    """Counters and gauges for ``/metrics``."""

    running: int = 0
    waiting: int = 0
    running_tokens: int = 0
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    steps_total: int = 0
    busy_seconds_total: float = 0.0  # wall time spent in steps (the rest the engine waited for work)
    finished: collections.Counter = field(default_factory=collections.Counter)


class Engine:
    """The scheduler loop. Start with :meth:`start` inside a running event loop."""

    def __init__(
        self,
        extractor: HiddenStateExtractor,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        capacity: CapacityModel | None = None,
        torch_threads: int = 0,
    ):
        self.extractor = extractor
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.capacity = capacity
        self.stats = EngineStats()
        self._torch_threads = torch_threads
        self._waiting: collections.deque[EngineRequest] = collections.deque()
        self._running: list[EngineRequest] = []
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._executor = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="hs-forward", initializer=self._init_thread
        )

    def _init_thread(self) -> None:
        if self._torch_threads:
            torch.set_num_threads(self._torch_threads)

    @property
    def seq_cap(self) -> int:
        if self.capacity is None:
            return self.max_num_seqs
        return min(self.max_num_seqs, self.capacity.max_concurrent_seqs)

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._loop(), name="hsgen-engine")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        for req in [*self._waiting, *self._running]:
            if req.future is not None and not req.future.done():
                req.future.set_exception(RuntimeError("server shutting down"))
        self._waiting.clear()
        self._running.clear()
        self._executor.shutdown(wait=True)

    async def generate(self, req: EngineRequest) -> EngineResult:
        """Queue ``req`` and wait for it; cancelling the caller aborts the request."""
        if not req.prompt_token_ids:
            raise ValueError("empty prompt")
        req.future = asyncio.get_running_loop().create_future()
        self._waiting.append(req)
        self._update_gauges()
        self._wake.set()
        return await req.future

    def _update_gauges(self) -> None:
        self.stats.waiting = len(self._waiting)
        self.stats.running = len(self._running)
        self.stats.running_tokens = sum(
            len(r.prompt_token_ids) + len(r.output_token_ids) for r in self._running
        )

    def _schedule(self) -> list[EngineRequest]:
        self._running = [r for r in self._running if r.future is not None and not r.future.done()]
        self._waiting = collections.deque(
            r for r in self._waiting if r.future is not None and not r.future.done()
        )
        longest = max((len(r.tokens) for r in self._running), default=0)
        while self._waiting and len(self._running) < self.seq_cap:
            cand = self._waiting[0]
            new_longest = max(longest, len(cand.tokens))
            if self._running and new_longest * (len(self._running) + 1) > self.max_num_batched_tokens:
                break
            self._running.append(self._waiting.popleft())
            longest = new_longest
        self._update_gauges()
        return list(self._running)

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            batch = self._schedule()
            if not batch:
                self._wake.clear()
                await self._wake.wait()
                continue
            t0 = time.perf_counter()
            prefill_tokens = sum(len(r.prompt_token_ids) for r in batch if r.prompt_hidden is None)
            decode_seqs = sum(1 for r in batch if r.prompt_hidden is not None)
            try:
                want = [r.prompt_logprobs if r.prompt_hidden is None else None for r in batch]
                outputs = await loop.run_in_executor(
                    self._executor,
                    self.extractor.forward,
                    [r.tokens for r in batch],
                    want if any(w is not None for w in want) else None,
                )
            except Exception as e:
                log.exception("forward failed for a batch of %d sequences", len(batch))
                for r in batch:
                    if r.future is not None and not r.future.done():
                        r.future.set_exception(e)
                self._running = []
                self._update_gauges()
                continue
            if self.capacity is not None:
                remaining = self.capacity.step_seconds(prefill_tokens, decode_seqs) - (
                    time.perf_counter() - t0
                )
                if remaining > 0:
                    await asyncio.sleep(remaining)
            self.stats.steps_total += 1
            self.stats.busy_seconds_total += time.perf_counter() - t0
            self._finish_step(batch, outputs)

    def _finish_step(self, batch, outputs) -> None:
        eos = self.extractor.loaded.eos_token_ids
        still_running = []
        for req, out in zip(batch, outputs, strict=True):
            if req.prompt_hidden is None:
                req.prompt_hidden = out.hidden_states
                req.prompt_logprobs_out = out.prompt_logprobs
                self.stats.prompt_tokens_total += len(req.prompt_token_ids)
            forward_tokens = req.tokens
            req.output_token_ids.append(out.next_token)
            self.stats.generation_tokens_total += 1
            stop = out.next_token in eos and not req.ignore_eos
            if len(req.output_token_ids) >= req.max_tokens or stop:
                reason = "stop" if stop else "length"
                self.stats.finished[reason] += 1
                if req.include_output_tokens:
                    result = EngineResult(
                        list(req.output_token_ids), reason, out.hidden_states, forward_tokens
                    )
                else:
                    result = EngineResult(
                        list(req.output_token_ids), reason, req.prompt_hidden, req.prompt_token_ids
                    )
                result.prompt_logprobs = req.prompt_logprobs_out
                if req.future is not None and not req.future.done():
                    req.future.set_result(result)
            else:
                still_running.append(req)
        self._running = still_running
        self._update_gauges()
