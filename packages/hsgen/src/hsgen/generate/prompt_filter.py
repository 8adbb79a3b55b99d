"""Which prompts become requests: this rank's share, each id once, only those not stored yet.

:func:`iterate` turns the prompt stream into an async iterator (a plain iterable is pulled in a
worker thread, since rendering costs CPU); :class:`PromptFilter` decides, prompt by prompt,
whether it is sent, and counts every other outcome in the run's report.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import AsyncIterable, AsyncIterator, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from hsgen.generate.report import RunReport
from hsgen.inputs.formats import InputError
from hsgen.inputs.render import Skipped
from hsgen.protocol.prompt import RenderedPrompt

log = logging.getLogger(__name__)

_SHOWN_WARNINGS = 5


def rank_of(sample_id: str, world_size: int) -> int:
    """The rank that owns ``sample_id``: a stable hash of the id, mod ``world_size``."""
    digest = hashlib.sha256(sample_id.encode()).digest()
    return int.from_bytes(digest[:8], "big") % world_size


def content_digest(prompt: RenderedPrompt) -> bytes:
    """8 bytes identifying a prompt's token ids and loss mask (what would be stored)."""
    h = hashlib.blake2b(digest_size=8)
    h.update(np.asarray(prompt.token_ids, dtype=np.int64).tobytes())
    h.update(np.asarray(prompt.loss_mask, dtype=np.uint8).tobytes())
    return h.digest()


async def iterate(items: Iterable[Any] | AsyncIterable[Any], batch: int = 32) -> AsyncIterator[Any]:
    """Iterate ``items``; a plain iterable is pulled in a worker thread, ``batch`` items at a time."""
    if hasattr(items, "__aiter__"):
        async for x in items:  # type: ignore[union-attr]
            yield x
        return
    it = iter(items)  # type: ignore[arg-type]
    loop = asyncio.get_running_loop()
    with ThreadPoolExecutor(1, thread_name_prefix="hsgen-input") as pool:
        deferred: list[BaseException] = []

        def pull() -> list[Any]:
            out: list[Any] = []
            try:
                for x in it:
                    out.append(x)
                    if len(out) >= batch:
                        break
            except Exception as e:  # deliver the items read before the error first
                if not out:
                    raise
                deferred.append(e)
            return out

        while True:
            if deferred:
                raise deferred.pop()
            chunk = await loop.run_in_executor(pool, pull)
            if not chunk:
                return
            for x in chunk:
                yield x


class PromptFilter:
    """Admits the prompts a run requests and counts the others in ``report.summary``.

    Args:
        world_size, rank: this process takes the ids with ``rank_of(id) == rank``.
        max_samples: admit at most this many (None = all).
        on_bad_input: ``"fail"`` raises :class:`~hsgen.inputs.formats.InputError` for an id repeated
            with different content; ``"skip"`` reports it (warning and failures-file line).
        report: where the counts and failures go.
    """

    def __init__(
        self, *, world_size: int, rank: int, max_samples: int | None, on_bad_input: str, report: RunReport
    ):
        self.world_size = world_size
        self.rank = rank
        self.max_samples = max_samples
        self.on_bad_input = on_bad_input
        self.report = report
        self.admitted = 0
        self.done = False
        """Set when a prompt arrives after ``max_samples`` were admitted: stop reading."""
        self.seen_any = False
        self._seen: dict[str, bytes] = {}
        self.claims: Any = None
        """A :class:`~hsgen.store.claims.WorkClaims` when joined: only claimed chunks are admitted."""
        self._pos = 0
        self._decided: dict[int, bool] = {}
        self._only: set[int] | None = None

    def restart(self, only: set[int]) -> None:
        """Start another pass over the same input, admitting only prompts of the chunks ``only``."""
        self._pos, self._seen, self._decided, self._only = 0, {}, {}, set(only)

    def _claimed(self, pos: int, store: Any) -> bool:
        c = pos // self.claims.chunk
        got = self._decided.get(c)
        if got is None:
            before = self.claims.taken_over
            got = self._decided[c] = self.claims.claim(c)
            if self.claims.taken_over != before and store is not None:
                store.refresh()  # what the dead claimant committed is not requested again
        return got

    def admit(self, item: RenderedPrompt | Skipped, store: Any) -> RenderedPrompt | None:
        """``item`` if it should be requested now, else None (and the reason is counted).

        Raises:
            InputError: an id repeats with other content and ``on_bad_input == "fail"``.
        """
        s = self.report.summary
        self.seen_any = True
        pos = self._pos
        self._pos += 1
        if self._only is not None and pos // self.claims.chunk not in self._only:
            if not isinstance(item, Skipped):
                self._seen.setdefault(item.sample_id, content_digest(item))
            return None
        if isinstance(item, Skipped):
            if self.claims is not None and not self._claimed(pos, store):
                return None
            if item.reason == "too_long":
                s.too_long += 1
            else:
                s.bad_input += 1
            self.report.record(item.sample_id, item.reason, item.message, source=item.source)
            return None
        sid = item.sample_id
        if self.world_size > 1 and rank_of(sid, self.world_size) != self.rank:
            s.other_rank += 1
            return None
        digest = content_digest(item)
        first = self._seen.get(sid)
        if first is not None:
            if first != digest:
                self._conflict(item)
            else:
                s.duplicates += 1
            return None
        self._seen[sid] = digest
        if self.claims is not None and not self._claimed(pos, store):
            s.other_writer += 1
            return None
        if store is not None and sid in store:
            s.already_done += 1
            return None
        if self.max_samples is not None and self.admitted >= self.max_samples:
            self.done = True
            return None
        if item.truncated:
            s.truncated += 1
        if 1 not in item.loss_mask:
            s.no_assistant_turn += 1
            if s.no_assistant_turn <= _SHOWN_WARNINGS:
                log.warning(
                    "%s: sample %r has no assistant turn: its loss mask is all 0, nothing in it is trained on",
                    item.source or "input",
                    sid,
                )
        self.admitted += 1
        return item

    def _conflict(self, item: RenderedPrompt) -> None:
        s = self.report.summary
        s.duplicate_conflicts += 1
        message = (
            f"sample id {item.sample_id!r} appears again with different content; "
            "the first record is used, this one is not"
        )
        if self.on_bad_input == "fail":
            raise InputError(item.source or "input", message + " (--on-bad-input skip goes on)")
        self.report.record(item.sample_id, "duplicate_id", message, source=item.source)
        if s.duplicate_conflicts <= _SHOWN_WARNINGS:
            log.warning("%s: %s", item.source or "input", message)


__all__ = ["PromptFilter", "content_digest", "iterate", "rank_of"]
