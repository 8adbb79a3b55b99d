"""Store maintenance behind ``hsgen gc``: leftovers, duplicate copies, damaged manifests.

- :func:`remove_leftovers`: temp files, uncommitted shards of dead writers, tombstoned shards.
- :func:`dedupe`: a sample id stored more than once (two writers fetched it) keeps its first copy;
  a shard holding only later copies is tombstoned, one holding some is rewritten without them.
- :func:`repair_manifests`: a dead writer's manifest with a bad line is rebuilt from the shards'
  own sample tables (``zarr.json``), keeping every sample whose checksum still matches.

Nothing of a live writer (its manifest lock is held) is touched.
"""

from __future__ import annotations

import json
import logging
import os
import time
from typing import TYPE_CHECKING

from hsgen.store.errors import StoreError
from hsgen.store.fsutil import fsync_dir, is_locked, tree_bytes, try_lock, write_all
from hsgen.store.manifest import MANIFEST_SUFFIX, ShardInfo, encode, parse_lines
from hsgen.store.shard import ShardReader
from hsgen.store.writer import SHARD_NAME, default_writer_id, remove_tree

if TYPE_CHECKING:
    from hsgen.store.view import StoreView

log = logging.getLogger(__name__)


def _alive(store: StoreView, writer: str) -> bool:
    return is_locked(store.path / "manifests" / f"{writer}{MANIFEST_SUFFIX}")


def remove_leftovers(store: StoreView, *, dry_run: bool, min_age_s: float, header_file: str) -> dict:
    """Remove temp files, uncommitted shards of dead writers and tombstoned shards.

    An uncommitted shard of a writer whose manifest is damaged is kept (its commit line may be
    the damaged one): ``repair_manifests`` decides about it.
    """
    replay = store.replay
    out = {"removed_temp": 0, "removed_deleted": 0, "removed_uncommitted": 0, "bytes_freed": 0}
    live_writers = 0
    kept_damaged = 0
    shards_dir = store.path / "shards"
    for writer in sorted(os.listdir(shards_dir)):
        wdir = shards_dir / writer
        if not wdir.is_dir():
            continue
        alive = _alive(store, writer)
        live_writers += alive
        damaged = f"{writer}{MANIFEST_SUFFIX}" in replay.damaged
        for entry in sorted(os.listdir(wdir)):
            rel = f"shards/{writer}/{entry}"
            if ".trash-" in entry or (".tmp-" in entry and not alive):
                kind = "removed_temp"
            elif SHARD_NAME.match(entry) and rel in replay.deleted:
                kind = "removed_deleted"
            elif SHARD_NAME.match(entry) and rel not in replay.shards and not alive:
                if damaged:
                    kept_damaged += 1
                    continue
                kind = "removed_uncommitted"
            else:
                continue
            out[kind] += 1
            out["bytes_freed"] += tree_bytes(wdir / entry)
            if not dry_run:
                log.info("gc: removing %s (%s)", rel, kind.removeprefix("removed_"))
                remove_tree(wdir / entry)
    now = time.time()
    for entry in os.listdir(store.path):
        p = store.path / entry
        if entry.startswith(f".{header_file}.tmp-") and now - p.stat().st_mtime > min_age_s:
            out["removed_temp"] += 1
            out["bytes_freed"] += p.stat().st_size
            if not dry_run:
                p.unlink(missing_ok=True)
    out["live_writers"] = live_writers
    out["kept_damaged"] = kept_damaged
    return out


def dedupe(store: StoreView, *, dry_run: bool, shard_bytes: int = 32 << 20) -> dict:
    """Drop the later copies of sample ids stored more than once (the first copy is the live one).

    Returns:
        ``duplicates_removed`` (copies), ``duplicate_bytes`` (their stored bytes, approx.),
        ``duplicates_kept`` (copies left: a live writer's, or in a partly duplicated fp8 shard,
        which cannot be rewritten without losing precision).
    """
    store.refresh()
    out = {"duplicates_removed": 0, "duplicate_bytes": 0, "duplicates_kept": 0}
    rewrite: list[tuple[ShardInfo, list[str]]] = []
    drop: list[ShardInfo] = []
    for info in store.live_shards():
        owned = [row[0] for i, row in enumerate(info.rows) if _owns(store.placement(row[0]), info, i)]
        copies = len(info.rows) - len(owned)
        if not copies:
            continue
        if _alive(store, info.writer) or (owned and store.header.codec == "fp8"):
            out["duplicates_kept"] += copies
            continue
        out["duplicates_removed"] += copies
        dup_tokens = sum(
            row[2] for i, row in enumerate(info.rows) if not _owns(store.placement(row[0]), info, i)
        )
        out["duplicate_bytes"] += info.nbytes * dup_tokens // max(1, info.tokens)
        if owned:
            rewrite.append((info, owned))
        else:
            drop.append(info)
    if dry_run or not (rewrite or drop):
        return out
    if rewrite:
        with store.writer(f"gc-{default_writer_id()}", shard_bytes=shard_bytes) as w:
            for info, ids in rewrite:
                for sample in store.read_many(ids, verify=True):
                    w.add(sample.sample_id, sample.hidden_states, sample.token_ids, sample.loss_mask,
                          target_ids=sample.target_ids)  # fmt: skip
                log.info(
                    "gc: %s copied without its %d duplicate samples", info.name, len(info.rows) - len(ids)
                )
    for info in drop + [info for info, _ in rewrite]:
        store.delete_shard(info.name)
    return out


def _owns(entry, info: ShardInfo, i: int) -> bool:
    return entry is not None and entry[0] is info and entry[1] == i


def repair_manifests(store: StoreView, *, dry_run: bool) -> dict:
    """Rebuild each dead writer's damaged manifest from its shards' own sample tables.

    For every shard the file mentions (in any intact line), the rows are read from the shard's
    ``zarr.json`` and kept when their checksum matches the data; a shard whose commit line was
    lost is committed again when it is complete on disk. Tombstones are kept. The new file
    replaces the old one atomically, under the writer's lock.

    Returns:
        ``repaired_manifests``, ``recovered_samples`` (rows the replay had lost),
        ``dropped_samples`` (rows whose bytes no longer match), ``skipped_live`` (damaged
        manifests of live writers, left alone).
    """
    store.refresh()
    out = {"repaired_manifests": 0, "recovered_samples": 0, "dropped_samples": 0, "skipped_live": 0}
    for name in sorted(store.replay.damaged):
        path = store.path / "manifests" / name
        fd = os.open(path, os.O_RDWR)
        try:
            if not try_lock(fd, attempts=1):
                out["skipped_live"] += 1
                log.warning("gc --repair: %s belongs to a live writer; run again once it has stopped", path)
                continue
            lines, found = _rebuild(store, name, fd)
            before = sum(len(s.rows) for s in store.replay.shards.values() if s.key[0] == name)
            out["recovered_samples"] += max(0, found["rows"] - before)
            out["dropped_samples"] += found["dropped"]
            out["repaired_manifests"] += 1
            if not dry_run:
                tmp = path.with_name(f".{name}.repair-{os.getpid()}")
                tfd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                try:
                    write_all(tfd, [b"".join(encode(r) for r in lines)])
                    os.fsync(tfd)
                finally:
                    os.close(tfd)
                os.replace(tmp, path)
                fsync_dir(path.parent)
                log.info(
                    "gc --repair: rewrote %s (%d samples in %d shards)", path, found["rows"], found["shards"]
                )
        finally:
            os.close(fd)
    if out["repaired_manifests"] and not dry_run:
        store.reload()
    return out


def _rebuild(store: StoreView, name: str, fd: int) -> tuple[list[dict], dict]:
    """The records of a repaired manifest ``name`` (read through ``fd``) and what was found."""
    size = os.fstat(fd).st_size
    data = os.pread(fd, size, 0)
    data = data[: data.rfind(b"\n") + 1]
    mentioned: dict[str, dict | None] = {}
    deletes: list[dict] = []
    for rec in parse_lines(data[:-1]) if data else []:
        if not isinstance(rec, dict) or not isinstance(rec.get("shard"), str):
            continue
        op = rec.get("op")
        if op == "add":
            mentioned.setdefault(rec["shard"], None)
        elif op == "commit":
            mentioned[rec["shard"]] = rec
        elif op == "delete":
            deletes.append({"op": "delete", "shard": rec["shard"]})
    lines: list[dict] = []
    found = {"rows": 0, "dropped": 0, "shards": 0}
    for shard, commit in mentioned.items():
        rows, tokens, codec = _intact_rows(store, shard)
        if rows is None:  # gone, or never complete: nothing of it can be read
            continue
        found["dropped"] += rows[1]
        kept = rows[0]
        found["rows"] += len(kept)
        found["shards"] += 1
        lines += [
            {"op": "add", "id": sid, "shard": shard, "offset": off, "length": n, "checksum": crc}
            for sid, off, n, crc in kept
        ]
        nbytes = int(commit["bytes"]) if commit else tree_bytes(store.path / shard)
        lines.append(
            {
                "op": "commit",
                "shard": shard,
                "samples": len(kept),
                "tokens": tokens,
                "bytes": nbytes,
                "codec": codec,
            }
        )
    return lines + deletes, found


def _intact_rows(store: StoreView, shard: str):
    """``((intact rows, dropped count), tokens, codec)`` of a shard from its own table, or ``(None, ...)``."""
    from hsgen.store import codecs as C

    try:
        reader = ShardReader(store.path / shard, store.header)
    except StoreError as e:
        log.warning("gc --repair: %s", e)
        return None, None, None
    try:
        table = [tuple(r) for r in reader.attrs["samples"]]
        tokens = int(reader.shape("hidden_states")[0])
        kept, dropped = [], 0
        for sid, off, n, crc in table:
            try:
                ok = C.checksum_like(crc, reader.stored_arrays(off, n)[0]) == crc
            except (StoreError, OSError, EOFError, ValueError):
                ok = False
            if ok:
                kept.append((sid, off, n, crc))
            else:
                dropped += 1
                log.warning("gc --repair: %s: sample %r no longer matches its checksum: dropped", shard, sid)
        return (kept, dropped), tokens, reader.codec
    except (StoreError, OSError, KeyError, TypeError, ValueError, json.JSONDecodeError) as e:
        log.warning("gc --repair: %s: unreadable shard table (%s)", shard, e)
        return None, None, None
    finally:
        reader.close()


__all__ = ["dedupe", "remove_leftovers", "repair_manifests"]
