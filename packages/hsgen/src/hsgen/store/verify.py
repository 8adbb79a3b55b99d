"""Full check of a store: every live shard's metadata and shapes, every sample's checksum."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from hsgen.progress import progress_bar

from . import codecs as C
from .errors import StoreError
from .header import StoreHeader
from .shard import TARGET_IDS, ShardReader

if TYPE_CHECKING:
    from .manifest import ShardInfo
    from .store import HiddenStateStore


def verify_store(store: HiddenStateStore, *, progress: bool = False) -> list[str]:
    """Problems found in ``store`` (one line each, naming the shard and sample); [] when healthy."""
    store.refresh()
    problems = list(store._replay.problems)
    live = store._live()
    bar = progress_bar(
        total=sum(s.tokens for s in live), unit="tok", unit_scale=True, disable=not progress, desc="verify"
    )
    for info in live:
        try:
            reader = store._shard_reader(info.name)
        except StoreError as e:
            problems.append(str(e))
            bar.update(info.tokens)
            continue
        try:
            problems += _verify_shard(store, info, reader, bar)
        finally:
            reader.close()
    bar.close()
    return problems


def _verify_shard(store: HiddenStateStore, info: ShardInfo, reader: ShardReader, bar) -> list[str]:
    where = store.path / info.name
    header = store.header
    problems = []
    try:
        shard_header = StoreHeader.from_dict(reader.attrs["header"])
        problems += [f"{where}: shard header differs: {p}" for p in header.compatible_with(shard_header)]
        if reader.codec != info.codec:
            problems.append(f"{where}: shard codec {reader.codec!r} but manifest says {info.codec!r}")
        table = {tuple(r) for r in reader.attrs["samples"]}
        if any(row not in table for row in info.rows):
            problems.append(f"{where}: sample table in zarr.json disagrees with the manifest")
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
            bar.update(info.tokens)
            return problems
        layout = reader._hidden_layout()
        if layout is not None:
            inner, row_bytes = layout
            n_chunks = -(-info.tokens // inner)
            want = n_chunks * inner * row_bytes + 16 * n_chunks + 4
            got = reader._files.size("hidden_states/c/0/0/0")
            if got != want:
                problems.append(f"{where}/hidden_states/c/0/0/0: {got} bytes, expected {want}")
                bar.update(info.tokens)
                return problems
    except (StoreError, OSError, KeyError, TypeError, ValueError) as e:
        bar.update(info.tokens)
        return [*problems, f"{where}: unreadable shard metadata ({e})"]
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
        except (StoreError, OSError, EOFError, ValueError) as e:
            problems.append(f"{where}: sample {sid!r}: {e}")
        bar.update(length)
    return problems
