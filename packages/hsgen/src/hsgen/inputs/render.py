"""Render prompts to token ids and an assistant-only loss mask, without torch or transformers.

The verifier's ``tokenizer.json`` is loaded with the ``tokenizers`` library and its chat
template is rendered with jinja2 the way Hugging Face does (sandboxed, ``trim_blocks``,
``lstrip_blocks``, ``loopcontrols``, ``raise_exception``, ``tojson``, ``strftime_now``), so
the ids equal ``AutoTokenizer.apply_chat_template(..., tokenize=True)``. ``import
transformers`` would import torch when it is installed; hsgen outside ``hsgen.serve`` never
does.

The loss mask marks what the verifier generates in every assistant turn: everything after the
template's generation prompt (a harmony channel header, a rendered ``<think>`` block, the
content) through the turn's end-of-turn token, and nothing the template adds after it (the
newline after ``<|im_end|>`` / ``<end_of_turn>``). ``loss_mask[t] == 1`` when the draft is
trained to predict token ``t``. Assistant spans are found by rendering each conversation
prefix incrementally, which works for any template whose prefixes render as prefixes; other
templates (an earlier turn rendered differently once a later turn follows: gpt-oss's
``<|end|>`` for ``<|return|>``, Qwen3's dropped reasoning; a system prompt moved into the last
user turn; a generation prompt the turn itself does not repeat) fall back to locating the
assistant content in the full rendering, after the preceding turn. The real templates of
every family are checked in ``tests/hsgen/inputs/test_family_chat_masks.py``.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Literal

from hsgen.inputs.formats import InputSample
from hsgen.protocol.prompt import RenderedPrompt

log = logging.getLogger(__name__)

OnTooLong = Literal["truncate", "skip"]

SPECIAL_TOKEN_KEYS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "pad_token",
    "sep_token",
    "cls_token",
    "mask_token",
)


@dataclass(frozen=True)
class Skipped:
    """An input that never became a request (bad record, too long), passed on for the report.

    Attributes:
        reason: ``bad_input`` or ``too_long``.
        message: what was wrong, naming the file and line.
        sample_id: the id, when known.
        source: ``file:line``.
    """

    reason: str
    message: str
    sample_id: str | None = None
    source: str = ""


class RenderError(ValueError):
    """A sample that cannot be rendered (template error, missing tokenizer, ...)."""


class TooLong(RenderError):
    """A sample longer than ``max_len`` with ``on_too_long="skip"``."""


@dataclass(frozen=True)
class RenderConfig:
    """How to turn samples into token ids.

    Attributes:
        tokenizer_path: local directory with ``tokenizer.json`` and ``tokenizer_config.json``
            (the verifier's); needed for ``messages`` and ``prompt`` samples.
        chat_template: a template file overriding the tokenizer's own.
        max_len: longest prompt in tokens (None = no limit). vLLM needs ``max_model_len - 1``.
        on_too_long: ``"truncate"`` keeps the first ``max_len`` tokens, ``"skip"`` drops the sample.
        template_kwargs: extra variables for the chat template (e.g. ``enable_thinking``).
    """

    tokenizer_path: str | None = None
    chat_template: str | None = None
    max_len: int | None = None
    on_too_long: OnTooLong = "truncate"
    template_kwargs: Mapping[str, Any] = field(default_factory=dict)


# --------------------------------------------------------------------------- chat template


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message: str):
    import jinja2

    raise jinja2.exceptions.TemplateError(message)


def _generation_extension():
    """A jinja2 extension accepting HF's ``{% generation %}...{% endgeneration %}`` blocks."""
    from jinja2 import nodes
    from jinja2.ext import Extension

    class GenerationBlock(Extension):
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_render", []), [], [], body).set_lineno(lineno)

        def _render(self, caller):
            return caller()

    return GenerationBlock


def compile_chat_template(source: str):
    """Compile a chat template with Hugging Face's jinja settings."""
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_generation_extension(), loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


def _token_text(value: Any) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def load_chat_template(tokenizer_dir: Path, override: str | None = None) -> str | None:
    """The chat template of a local tokenizer directory (HF layouts old and new), or ``override``."""
    if override:
        return Path(override).read_text()
    jinja_file = tokenizer_dir / "chat_template.jinja"
    if jinja_file.exists():
        return jinja_file.read_text()
    json_file = tokenizer_dir / "chat_template.json"
    if json_file.exists():
        value = json.loads(json_file.read_text()).get("chat_template")
        if isinstance(value, str):
            return value
    config_file = tokenizer_dir / "tokenizer_config.json"
    if config_file.exists():
        value = json.loads(config_file.read_text()).get("chat_template")
        if isinstance(value, str):
            return value
        if isinstance(value, list):  # [{"name": "default", "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in value if isinstance(t, Mapping)}
            if isinstance(named.get("default"), str):
                return named["default"]
    return None


# --------------------------------------------------------------------------- renderer


class ChatRenderer:
    """Renders samples with a local tokenizer directory. Thread-safe after construction."""

    def __init__(self, config: RenderConfig):
        if config.on_too_long not in ("truncate", "skip"):
            raise ValueError(f"on_too_long must be 'truncate' or 'skip', got {config.on_too_long!r}")
        if config.max_len is not None and config.max_len < 1:
            raise ValueError(f"max_len must be >= 1, got {config.max_len}")
        self.config = config
        self._tokenizer = None
        self._added: list[str] = []
        self._template = None
        self._template_source: str | None = None
        self._special: dict[str, Any] = {}
        self._fingerprint = ""
        if config.tokenizer_path:
            self._load(Path(config.tokenizer_path))

    def _load(self, path: Path) -> None:
        try:
            import jinja2  # noqa: F401 - the chat template needs it too
            from tokenizers import Tokenizer
        except ImportError as e:
            raise RenderError(
                f"rendering with a tokenizer needs tokenizers and jinja2 ({e.name} is missing): "
                "pip install 'hsgen[render]'"
            ) from None

        tok_file = path / "tokenizer.json"
        if not tok_file.exists():
            raise RenderError(
                f"{path}: no tokenizer.json (a local Hugging Face model or tokenizer directory is needed)"
            )
        tok_bytes = tok_file.read_bytes()
        self._tokenizer = Tokenizer.from_str(tok_bytes.decode("utf-8"))
        cfg_file = path / "tokenizer_config.json"
        cfg = json.loads(cfg_file.read_text()) if cfg_file.exists() else {}
        for key in SPECIAL_TOKEN_KEYS:
            text = _token_text(cfg.get(key))
            if text is not None:
                self._special[key] = text
        extra = cfg.get("additional_special_tokens") or cfg.get("extra_special_tokens")
        if isinstance(extra, list):
            self._special["additional_special_tokens"] = [_token_text(t) for t in extra]
        self._added = sorted(
            {t.content for t in self._tokenizer.get_added_tokens_decoder().values() if t.content},
            key=len,
            reverse=True,
        )
        self._template_source = load_chat_template(path, self.config.chat_template)
        if self._template_source is not None:
            self._template = compile_chat_template(self._template_source)
        h = hashlib.sha256()
        h.update(b"tokenizer.json\0")
        h.update(hashlib.sha256(tok_bytes).digest())
        h.update(b"\0chat_template\0")
        h.update((self._template_source or "").encode())
        h.update(b"\0special\0")
        h.update(json.dumps(self._special, sort_keys=True).encode())
        self._fingerprint = h.hexdigest()

    @property
    def fingerprint(self) -> str:
        """sha256 of tokenizer.json, chat template and special tokens ("" without a tokenizer)."""
        return self._fingerprint

    # ---------------------------------------------------------------- text level

    def apply_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = False,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> str:
        """Render messages to text with the chat template (like HF ``tokenize=False``)."""
        if self._tokenizer is None:
            raise RenderError(
                "rendering conversations needs the verifier's tokenizer: pass --tokenizer DIR or a hub id"
            )
        if self._template is None:
            raise RenderError("the tokenizer has no chat_template: pass --chat-template FILE")
        import jinja2

        try:
            return self._template.render(
                messages=[dict(m) for m in messages],
                tools=[dict(t) for t in tools] if tools else None,
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **self._special,
                **dict(self.config.template_kwargs),
            )
        except jinja2.exceptions.TemplateError as e:
            raise RenderError(f"chat template failed: {e}") from None

    def encode(
        self, text: str, *, add_special_tokens: bool = False
    ) -> tuple[list[int], list[tuple[int, int]]]:
        """Token ids and character offsets of ``text``."""
        if self._tokenizer is None:
            raise RenderError(
                "rendering text needs a tokenizer: pass --tokenizer DIR or a hub id (the verifier's)"
            )
        enc = self._tokenizer.encode(text, add_special_tokens=add_special_tokens)
        return list(enc.ids), list(enc.offsets)

    def assistant_spans(
        self,
        messages: Sequence[Mapping[str, Any]],
        full: str,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> list[tuple[int, int]]:
        """Character spans of what the verifier generates in each assistant turn of ``full``."""
        spans: list[tuple[int, int]] = []
        cursor = 0
        for i, m in enumerate(messages):
            if m.get("role") != "assistant":
                continue
            pre = self._safe_prefix(messages[:i], tools)
            upto = self.apply_template(messages[: i + 1], tools=tools)
            if pre is not None and upto.startswith(pre) and full.startswith(upto) and len(pre) >= cursor:
                span = (len(pre), len(upto))
            else:
                span = self._locate(messages, i, full, cursor, pre, upto)
                if span is None:
                    raise RenderError(
                        f"cannot find assistant turn {i} in the rendered conversation: the chat template "
                        "rewrites it (render with the server, or pass a loss_mask with input_ids)"
                    )
            span = self._trim_after_end(full, span)
            spans.append(span)
            cursor = span[1]
        return spans

    def _safe_prefix(self, messages: Sequence[Mapping[str, Any]], tools) -> str | None:
        try:
            return self.apply_template(messages, add_generation_prompt=True, tools=tools)
        except RenderError:
            if not messages:
                return ""
            return None

    def _locate(self, messages, i: int, full: str, cursor: int, pre: str | None, upto: str):
        """Span of assistant turn ``i`` in ``full`` when its prefixes do not render as prefixes.

        The turn starts where the generation prompt ends when ``full`` starts with it, else at its
        content; the content is looked for after the preceding message's own text (so a user turn
        quoting the reply is never taken for it). The turn ends after the text that follows the
        content when it renders last, or else after the one added token (its end-of-turn marker)
        right after the content.
        """
        content = _text_of(messages[i])
        if not content.strip():
            return None
        content = content.strip()
        generated_from = len(pre) if pre is not None and full.startswith(pre) and len(pre) >= cursor else None
        floor = cursor if generated_from is None else generated_from
        previous = (
            _text_of(messages[i - 1]).strip() if i and messages[i - 1].get("role") != "assistant" else ""
        )
        if generated_from is None and previous:
            k = full.find(previous, floor)
            if k >= 0:
                floor = k + len(previous)
        # reasoning templates drop the <think> block of earlier turns: try the visible answer
        idx = -1
        for cand in (content, content.split("</think>")[-1].strip()):
            if cand:
                idx = full.find(cand, floor)
                if idx >= 0:
                    content = cand
                    break
        if idx < 0:
            return None
        end = idx + len(content)
        segment = upto[len(pre) :] if pre is not None and upto.startswith(pre) else upto
        k = segment.rfind(content)
        tail = segment[k + len(content) :] if k >= 0 else ""
        if tail and full.startswith(tail, end):
            end += len(tail)
        else:
            marker = next((t for t in self._added if full.startswith(t, end)), None)
            if marker is not None:
                end += len(marker)
        return (idx if generated_from is None else generated_from), end

    @staticmethod
    def _trim_after_end(full: str, span: tuple[int, int]) -> tuple[int, int]:
        """``span`` without the whitespace a template writes after the turn (``<|im_end|>\\n``)."""
        a, b = span
        kept = len(full[a:b].rstrip())
        return (a, a + kept) if kept else span

    # ---------------------------------------------------------------- samples

    def render(self, sample: InputSample) -> RenderedPrompt:
        """Token ids and loss mask of one sample, with ``max_len`` applied.

        Raises:
            RenderError: the sample cannot be rendered (names its source).
            TooLong: the sample exceeds ``max_len`` and ``on_too_long == "skip"``.
        """
        try:
            if sample.kind == "tokens":
                ids = list(sample.input_ids or ())
                mask = list(sample.loss_mask) if sample.loss_mask is not None else [1] * len(ids)
            elif sample.kind == "prompt":
                ids, _ = self.encode(sample.prompt or "", add_special_tokens=True)
                mask = [1] * len(ids)
            else:
                ids, mask = self.render_messages(sample.messages or (), sample.tools)
        except RenderError as e:
            raise RenderError(f"{sample.source}: {e}") from None
        if not ids:
            raise RenderError(f"{sample.source}: renders to no tokens")
        return self._limit(RenderedPrompt(sample.sample_id, ids, mask, source=sample.source))

    def render_messages(
        self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None = None
    ) -> tuple[list[int], list[int]]:
        """Token ids of a whole conversation (no generation prompt) and its assistant mask."""
        full = self.apply_template(messages, tools=tools)
        ids, offsets = self.encode(full)
        spans = self.assistant_spans(messages, full, tools)
        mask = [0] * len(ids)
        j = 0
        for t, (s, e) in enumerate(offsets):
            while j < len(spans) and spans[j][1] <= s:
                j += 1
            if j == len(spans):
                break
            a, b = spans[j]
            if (s < b and e > a) or (s == e and a <= s < b):
                mask[t] = 1
        return ids, mask

    def _limit(self, p: RenderedPrompt) -> RenderedPrompt:
        return limit_length(p, self.config.max_len, self.config.on_too_long)


def _text_of(message: Mapping[str, Any]) -> str:
    """The text of a message's ``content`` (the text parts of a list), "" when it has none."""
    content = message.get("content")
    if isinstance(content, list):
        content = "".join(p.get("text", "") for p in content if isinstance(p, Mapping))
    return content if isinstance(content, str) else ""


def limit_length(p: RenderedPrompt, max_len: int | None, on_too_long: str) -> RenderedPrompt:
    """``p`` within ``max_len`` tokens: truncated (marked), or ``TooLong`` with ``on_too_long="skip"``."""
    if max_len is None or len(p.token_ids) <= max_len:
        return p
    if on_too_long == "skip":
        raise TooLong(f"{p.source}: {len(p.token_ids)} tokens > --max-len {max_len}")
    return RenderedPrompt(p.sample_id, p.token_ids[:max_len], p.loss_mask[:max_len], True, p.source)


# --------------------------------------------------------------------------- streams


def render_stream(
    paths: Sequence[str],
    renderer: ChatRenderer,
    *,
    on_bad_input: str = "fail",
    stdin=None,
):
    """Read and render every record of ``paths``, yielding ``RenderedPrompt`` or ``Skipped``.

    A bad record (unreadable, wrong fields, template failure) raises ``InputError`` /
    ``RenderError`` with ``on_bad_input="fail"``, else becomes ``Skipped("bad_input", ...)``;
    a record over ``max_len`` with ``on_too_long="skip"`` becomes ``Skipped("too_long", ...)``.
    """
    from hsgen.inputs.formats import InputError, iter_records

    check_on_bad_input(on_bad_input)
    for path in paths:
        for source, rec in iter_records(path, stdin=stdin):
            sample = None
            try:
                sample = parse_input(rec, source)
                yield renderer.render(sample)
            except (InputError, RenderError) as e:
                yield skipped_record(e, sample and sample.sample_id, source, on_bad_input)


def parse_input(rec, source: str) -> InputSample:
    """The sample of one record from ``iter_records`` (an ``InputError`` read in its place is raised)."""
    from hsgen.inputs.formats import InputError, parse_record

    if isinstance(rec, InputError):
        raise rec
    return parse_record(rec, source)


def check_on_bad_input(on_bad_input: str) -> None:
    if on_bad_input not in ("skip", "fail"):
        raise ValueError(f"on_bad_input must be 'skip' or 'fail', got {on_bad_input!r}")


def skipped_record(error: Exception, sample_id: str | None, source: str, on_bad_input: str):
    """The ``Skipped`` record for a sample that failed to read or render (re-raised with ``"fail"``)."""
    if isinstance(error, TooLong):
        log.info("skipping %s", error)
        return Skipped("too_long", str(error), sample_id, source)
    if on_bad_input == "fail":
        raise error
    log.warning("skipping bad input: %s", error)
    return Skipped("bad_input", str(error), sample_id, source)


__all__ = [
    "ChatRenderer",
    "OnTooLong",
    "RenderConfig",
    "RenderError",
    "RenderedPrompt",
    "Skipped",
    "TooLong",
    "check_on_bad_input",
    "compile_chat_template",
    "limit_length",
    "load_chat_template",
    "parse_input",
    "render_stream",
    "skipped_record",
]
