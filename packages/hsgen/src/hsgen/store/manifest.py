"""Manifests: one append-only JSON-lines file per writer, replayed into the set of live samples.

Record kinds (one JSON object per line, ``\\n``-terminated, see ``docs/format.md``):

- ``{"op": "add", "id", "shard", "offset", "length", "checksum"}``: a sample of a shard;
- ``{"op": "commit", "shard", "samples", "tokens", "bytes", "codec"}``: the shard's adds above
  it are complete; adds without a later commit in the same file are ignored;
- ``{"op": "delete", "shard"}``: a tombstone; the shard's samples are gone for good.

A line without its final newline is torn (its writer died or is writing) and is ignored. A bad
line elsewhere is reported as a problem and costs only its own record: a commit keeps the rows
whose add lines are intact (``hsgen gc --repair`` rebuilds the file from the shards' own tables).
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

from hsgen.store.errors import StoreError
from hsgen.store.fsutil import FAILPOINT_ENV, failpoint, fsync_dir, try_lock, write_all

log = logging.getLogger(__name__)

MANIFEST_SUFFIX = ".jsonl"


@dataclass
class ShardInfo:
    """A committed shard as the manifests describe it."""

    name: str
    writer: str
    key: tuple[str, int]
    """(manifest file name, line number of the commit): orders shards and breaks duplicate-id ties."""
    rows: list[tuple[str, int, int, str]]
    """(sample_id, offset, length, checksum) per sample."""
    tokens: int
    nbytes: int
    codec: str
    hidden: int = 0
    """Samples the commit counts whose add lines are damaged: stored, yet no reader sees them
    until ``hsgen gc --repair`` rebuilds the manifest (a trainer counts them as lost)."""


@dataclass
class _FileState:
    pos: int = 0
    line_no: int = 0
    pending: dict[str, list[tuple[str, int, int, str]]] = field(default_factory=dict)


@dataclass
class ReplayDelta:
    """What one :meth:`ManifestReplay.refresh` found new."""

    committed: list[ShardInfo] = field(default_factory=list)
    deleted: list[str] = field(default_factory=list)


def encode(record: dict) -> bytes:
    """One manifest line for ``record``."""
    return json.dumps(record, separators=(",", ":"), ensure_ascii=False).encode() + b"\n"


def parse_lines(block: bytes) -> list[dict | Exception]:
    """Parse newline-separated JSON records; a line that fails yields its exception instead.

    Parses the whole block in one ``json.loads`` call (several times faster than line by line) and
    falls back to line by line only when some line is bad.
    """
    if not block:
        return []
    try:
        records = json.loads(b"[" + block.replace(b"\n", b",") + b"]")
        if all(isinstance(r, dict) for r in records):
            return records
    except ValueError:
        pass
    out: list[dict | Exception] = []
    for line in block.split(b"\n"):
        try:
            rec = json.loads(line)
            out.append(rec if isinstance(rec, dict) else ValueError("not a JSON object"))
        except ValueError as e:
            out.append(e)
    return out


def summarize(manifests: Path) -> dict:
    """Totals of live shards from commit and delete lines only (add lines are not parsed).

    Returns:
        ``samples``, ``tokens``, ``bytes``, ``shards``, ``writer_ids``, ``deleted_shards``,
        ``manifest_problems``. Duplicate sample ids are counted once per copy.
    """
    commits: dict[str, tuple[str, dict]] = {}
    deleted: set[str] = set()
    problems = 0
    for name in sorted(n for n in os.listdir(manifests) if n.endswith(MANIFEST_SUFFIX)):
        data = (manifests / name).read_bytes()
        data = data[: data.rfind(b"\n") + 1]
        for line in data.split(b"\n")[:-1]:
            if line.startswith(b'{"op":"add"'):
                continue
            try:
                rec = json.loads(line)
                if rec["op"] == "commit":
                    commits[rec["shard"]] = (name[: -len(MANIFEST_SUFFIX)], rec)
                elif rec["op"] == "delete":
                    deleted.add(rec["shard"])
                elif rec["op"] != "add":
                    problems += 1
            except (ValueError, KeyError, TypeError):
                problems += 1
    live = [(w, rec) for shard, (w, rec) in commits.items() if shard not in deleted]
    return {
        "samples": sum(int(r["samples"]) for _, r in live),
        "tokens": sum(int(r["tokens"]) for _, r in live),
        "bytes": sum(int(r["bytes"]) for _, r in live),
        "shards": len(live),
        "writer_ids": sorted({w for w, _ in live}),
        "deleted_shards": len(deleted),
        "manifest_problems": problems,
    }


class ManifestReplay:
    """Incrementally replays every manifest file of a store (reads only bytes appended since last time)."""

    def __init__(self, manifests: Path):
        self.dir = manifests
        self._files: dict[str, _FileState] = {}
        self.shards: dict[str, ShardInfo] = {}
        """Every committed shard, deleted or not."""
        self.deleted: set[str] = set()
        self.problems: list[str] = []
        """Bad lines (file:line: reason); verify reports them."""
        self.damaged: set[str] = set()
        """Manifest files with a problem (``hsgen gc --repair`` rewrites them)."""

    def refresh(self) -> ReplayDelta:
        """Read what was appended to each manifest since the last call."""
        delta = ReplayDelta()
        try:
            names = sorted(n for n in os.listdir(self.dir) if n.endswith(MANIFEST_SUFFIX))
        except FileNotFoundError as e:
            raise StoreError(f"{self.dir}: manifest directory is missing") from e
        for name in names:
            self._refresh_file(name, delta)
        return delta

    def _refresh_file(self, name: str, delta: ReplayDelta) -> None:
        state = self._files.setdefault(name, _FileState())
        path = self.dir / name
        try:
            with open(path, "rb") as f:
                f.seek(state.pos)
                data = f.read()
        except FileNotFoundError:
            return
        end = data.rfind(b"\n")
        if end < 0:
            return
        state.pos += end + 1
        self._apply_block(name, name[: -len(MANIFEST_SUFFIX)], str(path), state, data[:end], delta)

    def _apply_block(
        self, name: str, writer: str, path: str, state: _FileState, block: bytes, delta: ReplayDelta
    ) -> None:
        """Replay the complete lines ``block`` of manifest ``name`` (of ``writer``) from ``state``."""
        pending = state.pending
        line_no = state.line_no
        for rec in parse_lines(block):
            line_no += 1
            try:
                if isinstance(rec, Exception):
                    raise rec
                op = rec["op"]
                if op == "add":
                    row = (rec["id"], rec["offset"], rec["length"], rec["checksum"])
                    if type(row[0]) is not str or type(row[1]) is not int or type(row[2]) is not int:
                        raise ValueError("id must be a string, offset and length integers")
                    if row[1] < 0 or row[2] <= 0:
                        raise ValueError("offset must be >= 0 and length > 0")
                    shard_rows = pending.get(rec["shard"])
                    if shard_rows is None:
                        pending[rec["shard"]] = [row]
                    else:
                        shard_rows.append(row)
                elif op == "commit":
                    shard = rec["shard"]
                    if shard in self.shards:
                        raise ValueError(f"shard {shard} committed twice")
                    rows = pending.pop(shard, [])
                    info = ShardInfo(
                        shard,
                        writer,
                        (name, line_no),
                        rows,
                        int(rec["tokens"]),
                        int(rec["bytes"]),
                        rec["codec"],
                    )
                    self.shards[shard] = info
                    delta.committed.append(info)
                    if len(rows) != rec["samples"]:
                        info.hidden = max(0, int(rec["samples"]) - len(rows))
                        # the intact rows stay readable; `hsgen gc --repair` recovers the others
                        self._problem(
                            name,
                            f"{path}:{line_no}: commit of {shard} says {rec['samples']} samples but only "
                            f"{len(rows)} intact add lines precede it (run hsgen gc --repair)",
                        )
                elif op == "delete":
                    if rec["shard"] not in self.deleted:
                        self.deleted.add(rec["shard"])
                        delta.deleted.append(rec["shard"])
                else:
                    raise ValueError(f"unknown op {op!r}")
            except (ValueError, KeyError, TypeError) as e:
                self._problem(name, f"{path}:{line_no}: invalid manifest record ({e})")
        state.line_no = line_no

    def _problem(self, name: str, message: str) -> None:
        log.warning("%s", message)
        self.problems.append(message)
        self.damaged.add(name)


class ManifestAppender:
    """The one writer of a manifest file: holds its flock, drops a torn tail, appends durably."""

    def __init__(self, path: Path, *, lock: bool = True):
        self.path = path
        created = not path.exists()
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            if lock and not try_lock(self.fd):
                raise StoreError(f"{path}: another process is writing with this writer id")
            self._drop_torn_tail()
            if created:
                fsync_dir(path.parent)
        except BaseException:
            os.close(self.fd)
            raise

    def _drop_torn_tail(self) -> None:
        size = os.fstat(self.fd).st_size
        keep = 0
        pos = size
        while pos > 0:
            start = max(0, pos - 65536)
            block = os.pread(self.fd, pos - start, start)
            nl = block.rfind(b"\n")
            if nl >= 0:
                keep = start + nl + 1
                break
            pos = start
        if keep != size:
            log.warning("%s: dropping a torn last line (%d bytes) left by a crash", self.path, size - keep)
            os.ftruncate(self.fd, keep)
            os.fsync(self.fd)

    def append(self, records: list[dict], *, fsync: bool = True) -> None:
        """Append ``records`` in one write, then fsync."""
        data = b"".join(encode(r) for r in records)
        if os.environ.get(FAILPOINT_ENV) == "manifest_torn":
            write_all(self.fd, [data[: len(data) // 2]])
            os.fsync(self.fd)
            failpoint("manifest_torn")
        try:
            write_all(self.fd, [data])
            if fsync:
                os.fsync(self.fd)
        except OSError as e:  # a write error (disk full) names the file
            raise OSError(e.errno, e.strerror, str(self.path)) from None

    def close(self) -> None:
        """Close the file (releases the lock)."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
