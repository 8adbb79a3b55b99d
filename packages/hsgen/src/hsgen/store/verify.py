"""Full check of a store: every live shard's metadata and shapes, every sample's checksum and values.

Every problem that costs samples names them: a shard that cannot be read (deleted directory,
truncated file, bad metadata) gives one line per sample it holds, so a user knows what to
regenerate; a sample whose stored values are NaN or infinite fails even under a valid checksum.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from hsgen.progress import progress_bar
from hsgen.store import codecs as C
from hsgen.store.errors import StoreError
from hsgen.store.header import StoreHeader
from hsgen.store.shard import TARGET_IDS, ShardReader

if TYPE_CHECKING:
    from hsgen.store.manifest import ShardInfo
    from hsgen.store.view import StoreView


@dataclass
class VerifyReport:
    """What :func:`verify_report` found."""

    problems: list[str] = field(default_factory=list)
    """One line each, naming the shard and, where samples are affected, each sample."""
    samples_affected: list[str] = field(default_factory=list)
    """Ids of the samples some problem names (unreadable, corrupt, not finite, or hidden by a
    damaged manifest line), each once, in the order met."""

    def add(self, message: str, sample_id: str | None = None) -> None:
        self.problems.append(message)
        if sample_id is not None and sample_id not in self._seen:
            self._seen.add(sample_id)
            self.samples_affected.append(sample_id)

    def __post_init__(self) -> None:
        self._seen: set[str] = set()


def verify_store(store: StoreView, *, progress: bool = False) -> list[str]:
    """Problems found in ``store`` (one line each, naming the shard and sample); [] when healthy."""
    return verify_report(store, progress=progress).problems


def verify_report(store: StoreView, *, progress: bool = False) -> VerifyReport:
    """Check ``store`` whole; the report names every sample a problem affects."""
    store.refresh()
    report = VerifyReport()
    for p in store.replay.problems:
        report.add(p)
    live = store.live_shards()
    bar = progress_bar(
        total=sum(s.tokens for s in live), unit="tok", unit_scale=True, disable=not progress, desc="verify"
    )
    for info in live:
        try:
            reader = store.shard_reader(info.name)
        except StoreError as e:
            _shard_lost(report, store, info, str(e))
            bar.update(info.tokens)
            continue
        try:
            _verify_shard(report, store, info, reader, bar)
        finally:
            reader.close()
    bar.close()
    return report


def _shard_lost(report: VerifyReport, store: StoreView, info: ShardInfo, cause: str) -> None:
    """``cause`` keeps the whole shard from being read: one line for it, one per sample it costs."""
    report.add(cause)
    where = store.path / info.name
    for sid, *_ in info.rows:
        report.add(f"{where}: sample {sid!r}: unreadable, its shard is damaged (above)", sid)


def _verify_shard(report: VerifyReport, store: StoreView, info: ShardInfo, reader: ShardReader, bar) -> None:
    where = store.path / info.name
    header = store.header
    problems = []
    try:
        shard_header = StoreHeader.from_dict(reader.attrs["header"])
        problems += [f"{where}: shard header differs: {p}" for p in header.compatible_with(shard_header)]
        if reader.codec != info.codec:
            problems.append(f"{where}: shard codec {reader.codec!r} but manifest says {info.codec!r}")
        _compare_tables(report, where, info, reader.attrs["samples"])
        expect = {
            "hidden_states": (
                (info.tokens, header.num_layers, header.hidden_size),
                C.hidden_storage_dtype(reader.codec, header.dtype),
            ),
            "token_ids": ((info.tokens,), np.dtype(np.int64)),
            "loss_mask": ((info.tokens,), np.dtype(np.uint8)),
        }
        if reader.codec == "fp8":
            expect["hidden_scale"] = ((info.tokens, header.num_layers), np.dtype(np.float32))
        if header.target_ids_stored:
            expect[TARGET_IDS] = ((info.tokens,), np.dtype(np.int32))
        for name, (shape, dtype) in expect.items():
            meta = reader.meta(name)
            if tuple(meta["shape"]) != shape or meta["data_type"] != dtype.name:
                problems.append(
                    f"{where}/{name}: shape {meta['shape']} {meta['data_type']}, expected {list(shape)} {dtype.name}"
                )
        if problems:
            _shard_lost(report, store, info, "; ".join(problems))
            bar.update(info.tokens)
            return
        layout = reader._hidden_layout()
        if layout is not None:
            inner, row_bytes = layout
            n_chunks = -(-info.tokens // inner)
            want = n_chunks * inner * row_bytes + 16 * n_chunks + 4
            got = reader._files.size("hidden_states/c/0/0/0")
            if got != want:
                _shard_lost(
                    report, store, info, f"{where}/hidden_states/c/0/0/0: {got} bytes, expected {want}"
                )
                bar.update(info.tokens)
                return
    except (StoreError, OSError, KeyError, TypeError, ValueError) as e:
        _shard_lost(report, store, info, "; ".join([*problems, f"{where}: unreadable shard metadata ({e})"]))
        bar.update(info.tokens)
        return
    for sid, offset, length, checksum in info.rows:
        try:
            if offset + length > info.tokens:
                raise ValueError(f"rows {offset}..{offset + length} exceed the shard's {info.tokens} tokens")
            arrays, targets = reader.stored_arrays(offset, length)
            got = C.checksum_like(checksum, arrays)
            if got != checksum:
                raise ValueError(f"checksum {got} != manifest {checksum}")
            loss_mask = arrays[-2 if targets is not None else -1]
            if loss_mask.size and loss_mask.max() > 1:
                raise ValueError("loss_mask holds values other than 0/1")
            if targets is not None and targets.size and targets.min() < 0:
                raise ValueError("target_ids holds negative token ids")
            bad = non_finite_count(
                arrays[0], header.dtype, reader.codec, arrays[1] if reader.codec == "fp8" else None
            )
            if bad:
                raise ValueError(
                    f"{bad} hidden-state values are not finite (NaN or inf) under a valid checksum"
                )
        except (StoreError, OSError, EOFError, ValueError) as e:
            report.add(f"{where}: sample {sid!r}: {e}", sid)
        bar.update(length)


def _compare_tables(report: VerifyReport, where, info: ShardInfo, table_rows) -> None:
    """Name each sample whose row in the shard's own table differs from the manifest's, and, when the
    commit counts more samples than intact add lines (a damaged add line hides some), each sample of
    the table that no intact manifest line holds. A row the commit does not count is no damage:
    ``hsgen gc --repair`` leaves a sample it dropped in the table and commits the shard without it."""
    table = {r[0]: tuple(r) for r in table_rows}
    listed = set()
    for row in info.rows:
        listed.add(row[0])
        own = table.get(row[0])
        if own != tuple(row):
            said = "missing" if own is None else f"(offset, length, checksum) {tuple(own[1:])}"
            report.add(
                f"{where}: sample {row[0]!r}: the shard's table in zarr.json says {said}, the manifest "
                f"{tuple(row[1:])}",
                row[0],
            )
    if not info.hidden:
        return
    for sid in table:
        if sid not in listed:
            report.add(
                f"{where}: sample {sid!r}: in the shard but in no intact manifest line (hsgen gc --repair "
                "recovers it)",
                sid,
            )


def non_finite_count(hidden: np.ndarray, dtype: str, codec: str, scale: np.ndarray | None = None) -> int:
    """How many values of ``hidden`` (stored form: bf16 as uint16, fp8 as uint8 e4m3 with its float32
    ``scale``) are NaN or infinite, read from the bit patterns (no decode)."""
    if codec == "fp8":
        bad = int(np.count_nonzero((hidden & 0x7F) == 0x7F))  # e4m3fn: NaN only, no inf
        if scale is not None:
            bad += int(np.count_nonzero(~np.isfinite(scale)))
        return bad
    if dtype == "bfloat16":
        return int(np.count_nonzero((hidden & 0x7F80) == 0x7F80))
    return int(hidden.size - np.count_nonzero(np.isfinite(hidden)))
