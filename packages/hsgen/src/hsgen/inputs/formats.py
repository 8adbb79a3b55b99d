"""Read prompt datasets: JSONL, JSON, Parquet files or stdin, in the formats people have.

Each record becomes an :class:`InputSample` in one of three kinds:

- ``messages``: OpenAI chat ``messages`` (``role``/``content``) or ShareGPT ``conversations``
  (``from``/``value``, normalized to OpenAI roles);
- ``tokens``: pre-tokenized ``input_ids`` with an optional ``loss_mask`` of the same length;
- ``prompt``: plain ``prompt`` (or ``text``) string.

Every sample has a stable id: the record's ``id`` (or ``sample_id``) field, else a hash of its
content, so re-runs and other ranks agree on which samples are done.
"""

from __future__ import annotations

import hashlib
import json
import logging
import sys
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Literal, TextIO

log = logging.getLogger(__name__)

OnBadInput = Literal["skip", "fail"]

ID_FIELDS = ("id", "sample_id")
SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
    "model": "assistant",
    "system": "system",
    "tool": "tool",
    "function": "tool",
    "observation": "tool",
}
OPENAI_ROLES = {"system", "user", "assistant", "tool", "developer", "function"}


class InputError(ValueError):
    """A record that cannot be read, with the file and line (or row) it came from."""

    def __init__(self, source: str, message: str):
        super().__init__(f"{source}: {message}")
        self.source = source
        self.reason = message


@dataclass(frozen=True)
class InputSample:
    """One prompt as read from a dataset, before rendering.

    Attributes:
        sample_id: stable id (dataset id field, else a content hash).
        kind: ``"messages"``, ``"tokens"`` or ``"prompt"``.
        source: ``file:line`` (or ``file:row N``) the record came from, for messages.
        messages: OpenAI-style messages (``kind == "messages"``).
        input_ids: token ids (``kind == "tokens"``).
        loss_mask: optional mask for ``input_ids`` (1 = train on this token).
        prompt: plain text (``kind == "prompt"``).
        tools: optional tool definitions passed to the chat template.
    """

    sample_id: str
    kind: Literal["messages", "tokens", "prompt"]
    source: str
    messages: tuple[Mapping[str, Any], ...] | None = None
    input_ids: tuple[int, ...] | None = None
    loss_mask: tuple[int, ...] | None = None
    prompt: str | None = None
    tools: tuple[Mapping[str, Any], ...] | None = None


@dataclass
class InputStats:
    """Counts kept while reading, reported at the end of a run."""

    read: int = 0
    bad: int = 0
    bad_examples: list[str] = field(default_factory=list)

    def note_bad(self, err: InputError) -> None:
        self.bad += 1
        if len(self.bad_examples) < 20:
            self.bad_examples.append(str(err))


def content_id(obj: Any) -> str:
    """Stable id for a record without an id field: sha256 of its canonical JSON, 32 hex chars."""
    raw = json.dumps(obj, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return "h" + hashlib.sha256(raw.encode()).hexdigest()[:32]


def parse_record(record: Any, source: str) -> InputSample:
    """Turn one decoded record (a dict) into an :class:`InputSample`.

    Raises:
        InputError: naming ``source`` and the offending field.
    """
    if not isinstance(record, Mapping):
        raise InputError(source, f"expected a JSON object, got {type(record).__name__}")
    sample_id = _record_id(record, source)
    tools = record.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise InputError(source, "field 'tools' must be a list")
    if "messages" in record or "conversations" in record:
        if "messages" in record:
            messages = _openai_messages(record["messages"], source, "messages")
        else:
            messages = _sharegpt_messages(record["conversations"], source)
        content: Any = {"messages": messages, **({"tools": tools} if tools else {})}
        return InputSample(
            sample_id or content_id(content),
            "messages",
            source,
            messages=tuple(messages),
            tools=tuple(tools) if tools else None,
        )
    if "input_ids" in record:
        ids = _int_list(record["input_ids"], source, "input_ids")
        if not ids:
            raise InputError(source, "field 'input_ids' is empty")
        mask = None
        if record.get("loss_mask") is not None:
            mask = _int_list(record["loss_mask"], source, "loss_mask")
            if len(mask) != len(ids):
                raise InputError(
                    source, f"field 'loss_mask' has {len(mask)} entries but 'input_ids' has {len(ids)}"
                )
            if any(m not in (0, 1) for m in mask):
                raise InputError(source, "field 'loss_mask' must contain only 0 and 1")
        return InputSample(
            sample_id or content_id({"input_ids": ids, "loss_mask": mask}),
            "tokens",
            source,
            input_ids=tuple(ids),
            loss_mask=tuple(mask) if mask is not None else None,
        )
    for key in ("prompt", "text"):
        if key in record:
            text = record[key]
            if not isinstance(text, str):
                raise InputError(source, f"field '{key}' must be a string, got {type(text).__name__}")
            if not text:
                raise InputError(source, f"field '{key}' is empty")
            return InputSample(sample_id or content_id({"prompt": text}), "prompt", source, prompt=text)
    raise InputError(
        source,
        "no prompt found: expected one of the fields 'messages', 'conversations', 'input_ids', "
        f"'prompt' or 'text' (got {sorted(record)[:8]})",
    )


def _record_id(record: Mapping[str, Any], source: str) -> str | None:
    for key in ID_FIELDS:
        if key in record and record[key] is not None:
            value = record[key]
            if isinstance(value, bool) or not isinstance(value, str | int):
                raise InputError(source, f"field '{key}' must be a string or integer")
            text = str(value)
            if not text or "\n" in text:
                raise InputError(source, f"field '{key}' must be a non-empty single-line string")
            return text
    return None


def _int_list(value: Any, source: str, name: str) -> list[int]:
    if hasattr(value, "tolist"):
        value = value.tolist()
    if not isinstance(value, list):
        raise InputError(source, f"field '{name}' must be a list of integers")
    out = []
    for i, v in enumerate(value):
        if isinstance(v, bool) or not isinstance(v, int):
            raise InputError(source, f"field '{name}[{i}]' must be an integer, got {v!r}")
        if v < 0:
            raise InputError(source, f"field '{name}[{i}]' is negative ({v})")
        out.append(int(v))
    return out


def _content_ok(content: Any) -> bool:
    if content is None or isinstance(content, str):
        return True
    # OpenAI content parts: [{"type": "text", "text": "..."}]
    return isinstance(content, list) and all(isinstance(p, Mapping) for p in content)


def _openai_messages(value: Any, source: str, name: str) -> list[dict[str, Any]]:
    if hasattr(value, "tolist"):
        value = value.tolist()
    if not isinstance(value, list) or not value:
        raise InputError(source, f"field '{name}' must be a non-empty list of messages")
    out = []
    for i, m in enumerate(value):
        if not isinstance(m, Mapping):
            raise InputError(source, f"{name}[{i}] must be an object with 'role' and 'content'")
        role = m.get("role")
        if role not in OPENAI_ROLES:
            raise InputError(source, f"{name}[{i}].role is {role!r}; expected one of {sorted(OPENAI_ROLES)}")
        if "content" not in m and not m.get("tool_calls"):
            raise InputError(source, f"{name}[{i}] has no 'content'")
        if not _content_ok(m.get("content")):
            raise InputError(source, f"{name}[{i}].content must be a string or a list of content parts")
        out.append({k: v for k, v in m.items() if v is not None})
    return out


def _sharegpt_messages(value: Any, source: str) -> list[dict[str, Any]]:
    if hasattr(value, "tolist"):
        value = value.tolist()
    if not isinstance(value, list) or not value:
        raise InputError(source, "field 'conversations' must be a non-empty list of turns")
    out = []
    for i, turn in enumerate(value):
        if not isinstance(turn, Mapping):
            raise InputError(source, f"conversations[{i}] must be an object with 'from' and 'value'")
        if "from" not in turn and "role" in turn:  # some ShareGPT dumps use OpenAI keys inside
            out.extend(_openai_messages([turn], source, f"conversations[{i}]"))
            continue
        speaker = turn.get("from")
        role = SHAREGPT_ROLES.get(str(speaker).lower()) if speaker is not None else None
        if role is None:
            raise InputError(
                source, f"conversations[{i}].from is {speaker!r}; expected one of {sorted(SHAREGPT_ROLES)}"
            )
        text = turn.get("value")
        if not isinstance(text, str):
            raise InputError(source, f"conversations[{i}].value must be a string")
        out.append({"role": role, "content": text})
    return out


# --------------------------------------------------------------------------- files


def _jsonl_records(f: IO, name: str) -> Iterator[tuple[str, Any]]:
    """Records of a JSONL stream (bytes or text); a line that is not UTF-8 or not JSON yields its error.

    Raises:
        InputError: the stream is a JSON document (an array, a pretty-printed object), not JSONL.
    """
    first = True
    for lineno, raw in enumerate(f, 1):
        source = f"{name}:{lineno}"
        if isinstance(raw, bytes):
            try:
                line = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")
            except UnicodeDecodeError as e:
                yield (
                    source,
                    InputError(source, f"not UTF-8 (byte 0x{raw[e.start]:02x} at column {e.start + 1})"),
                )
                continue
        else:
            line = raw
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            if first:
                _refuse_whole_json(name, line)
            yield source, InputError(source, f"invalid JSON: {e.msg} (column {e.colno})")
        else:
            if first and isinstance(rec, list):
                raise InputError(
                    name, "is one JSON array, not JSON Lines (one object per line): name it .json"
                )
            yield source, rec
        first = False


def _refuse_whole_json(name: str, first_line: str) -> None:
    """A JSONL input whose first line is the start of a pretty-printed JSON document (``[`` or
    ``{`` alone, or an array left open) is the wrong format, not a file of bad lines: refuse it
    whole, whatever ``--on-bad-input`` says (skipping would skip every line and store nothing)."""
    head = first_line.strip()
    if head in ("[", "{") or head.startswith(("[{", "[ {", '["')):
        kind = "array" if head.startswith("[") else "object"
        raise InputError(
            name,
            f"is a pretty-printed JSON {kind}, not JSON Lines (one object per line): name it .json, "
            "or write one object per line",
        )


def _json_records(path: Path) -> Iterator[tuple[str, Any]]:
    try:
        data = json.loads(path.read_bytes().decode("utf-8-sig"))
    except OSError as e:
        raise InputError(str(path), e.strerror or str(e)) from None
    except UnicodeDecodeError as e:
        raise InputError(
            str(path), f"not UTF-8 (byte 0x{e.object[e.start]:02x} at offset {e.start})"
        ) from None
    except json.JSONDecodeError as e:
        raise InputError(f"{path}:{e.lineno}", f"invalid JSON: {e.msg} (column {e.colno})") from None
    if isinstance(data, Mapping):
        for key in ("data", "samples", "rows"):
            if isinstance(data.get(key), list):
                data = data[key]
                break
        else:
            data = [data]
    if not isinstance(data, list):
        raise InputError(str(path), "a .json dataset must be a list of objects (or an object with 'data')")
    for i, rec in enumerate(data):
        yield f"{path}:item {i}", rec


def _parquet_records(path: Path, batch_rows: int = 1024) -> Iterator[tuple[str, Any]]:
    try:
        import pyarrow.parquet as pq
    except ImportError as e:  # pragma: no cover - pyarrow is an optional extra
        raise InputError(str(path), "reading Parquet needs pyarrow: pip install 'hsgen[parquet]'") from e
    try:
        pf = pq.ParquetFile(path)
    except Exception as e:  # pyarrow raises several types for a bad file
        raise InputError(str(path), f"not a readable Parquet file: {e}") from None
    row = 0
    for batch in pf.iter_batches(batch_size=batch_rows):
        for rec in batch.to_pylist():
            yield f"{path}:row {row}", rec
            row += 1


def iter_records(path: str | Path | Any, stdin: TextIO | None = None) -> Iterator[tuple[str, Any]]:
    """Yield ``(source, decoded record or InputError)`` for every record of one input.

    ``path == "-"`` reads JSONL from ``stdin`` (default ``sys.stdin``). The format follows the
    suffix: ``.jsonl``/``.ndjson`` (also ``.gz``), ``.json``, ``.parquet``. A dataset directory,
    a hub dataset id or a :class:`hsgen.inputs.hf_datasets.DatasetSpec` is read with ``datasets``.
    """
    from hsgen.inputs import hf_datasets

    if isinstance(path, hf_datasets.DatasetSpec) or (
        str(path) != "-" and hf_datasets.is_dataset_input(str(path))
    ):
        spec = path if isinstance(path, hf_datasets.DatasetSpec) else hf_datasets.DatasetSpec(str(path))
        try:
            yield from hf_datasets.iter_dataset_records(spec)
        except hf_datasets.DatasetInputError as e:
            raise InputError(str(spec), str(e).removeprefix(f"{spec}: ")) from None
        return
    if str(path) == "-":
        stream = stdin if stdin is not None else sys.stdin
        yield from _jsonl_records(getattr(stream, "buffer", stream), "<stdin>")
        return
    p = Path(path)
    if not p.exists():
        raise InputError(str(p), "no such file")
    if p.is_dir():
        raise InputError(str(p), "is a directory, not a dataset file")
    suffixes = [s.lower() for s in p.suffixes]
    suffix = suffixes[-1] if suffixes else ""
    if suffix == ".parquet":
        yield from _parquet_records(p)
    elif suffix == ".json":
        yield from _json_records(p)
    elif suffix in (".jsonl", ".ndjson", "", ".gz"):
        yield from _jsonl_file(p, gzipped=suffix == ".gz")
    else:
        raise InputError(str(p), f"unknown dataset format {suffix!r}: use .jsonl, .json or .parquet")


def _jsonl_file(p: Path, *, gzipped: bool) -> Iterator[tuple[str, Any]]:
    import gzip

    try:
        f = gzip.open(p, "rb") if gzipped else open(p, "rb")  # noqa: SIM115 - closed below
    except OSError as e:
        raise InputError(str(p), e.strerror or str(e)) from None
    with f:
        try:
            yield from _jsonl_records(f, str(p))
        except (OSError, EOFError) as e:  # a read error, a corrupt .gz
            raise InputError(str(p), getattr(e, "strerror", None) or str(e)) from None


def read_inputs(
    paths: Iterable[str | Path],
    *,
    on_bad_input: OnBadInput = "fail",
    stats: InputStats | None = None,
    stdin: TextIO | None = None,
) -> Iterator[InputSample]:
    """Yield every valid sample of the given inputs, in order.

    Args:
        paths: dataset files, or ``"-"`` for JSONL on stdin.
        on_bad_input: ``"fail"`` raises :class:`InputError` at the first bad record;
            ``"skip"`` logs it, counts it in ``stats`` and goes on.
        stats: filled with counts of read and bad records.
        stdin: stream used for ``"-"`` (tests pass a ``StringIO``).
    """
    if on_bad_input not in ("skip", "fail"):
        raise ValueError(f"on_bad_input must be 'skip' or 'fail', got {on_bad_input!r}")
    stats = stats if stats is not None else InputStats()
    for path in paths:
        for source, rec in iter_records(path, stdin=stdin):
            try:
                if isinstance(rec, InputError):
                    raise rec
                sample = parse_record(rec, source)
            except InputError as err:
                if on_bad_input == "fail":
                    raise
                stats.note_bad(err)
                log.warning("skipping bad input: %s", err)
                continue
            stats.read += 1
            yield sample


def sample_to_json(sample: InputSample) -> dict[str, Any]:
    """The JSON form of a sample (a record :func:`parse_record` reads back to the same sample)."""
    out: dict[str, Any] = {"id": sample.sample_id}
    if sample.kind == "messages":
        out["messages"] = [dict(m) for m in sample.messages or ()]
        if sample.tools:
            out["tools"] = [dict(t) for t in sample.tools]
    elif sample.kind == "tokens":
        out["input_ids"] = list(sample.input_ids or ())
        if sample.loss_mask is not None:
            out["loss_mask"] = list(sample.loss_mask)
    else:
        out["prompt"] = sample.prompt
    return out


__all__ = [
    "InputError",
    "InputSample",
    "InputStats",
    "OnBadInput",
    "content_id",
    "iter_records",
    "parse_record",
    "read_inputs",
    "sample_to_json",
]
