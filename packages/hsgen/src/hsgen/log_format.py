"""Log lines as every command of both packages writes them: to stderr, with no credentials.

A URL reaches a log line by many routes (an endpoint template expanded per rank, ranks from the
launcher's environment, a config file, an exception's message), so besides each call site
redacting what it prints (:func:`hsgen.protocol.extraction.redact_url`), the handler's formatter redacts the
finished line: the ``user:key@`` of any ``scheme://`` URL in it, a traceback's included, becomes
``<redacted>@``.
"""

from __future__ import annotations

import logging
import re
import sys

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

_USERINFO = re.compile(r"(\b[A-Za-z][A-Za-z0-9+.-]*://)[^\s/?#\"']*@")
"""``scheme://`` and the userinfo after it, up to the authority's last ``@`` (a key may hold one)."""

_BARE_USERINFO = re.compile(
    r"(?<![^\s\"'(\[{=,])[^\s/?#@\"'<>()\[\]{}=,]+@(?=(?:[A-Za-z0-9.-]+|\[[0-9A-Fa-f:.]+\]):[0-9{])"
)
"""The userinfo of an endpoint written without a scheme (``user:key@host:8000``, or a template's
``host:{8000+local_rank}``), which the client gives ``http://``: a word ending in ``@`` before a
host and a port."""


def redact_text(text: str) -> str:
    """``text`` with the userinfo of every ``scheme://user:key@host`` URL in it, and of every
    ``user:key@host:port`` endpoint written without a scheme, replaced by ``<redacted>``."""
    if "@" not in text:
        return text
    return _BARE_USERINFO.sub("<redacted>@", _USERINFO.sub(r"\1<redacted>@", text))


class RedactingFormatter(logging.Formatter):
    """A :class:`logging.Formatter` whose lines carry no URL credentials (see :func:`redact_text`)."""

    def format(self, record: logging.LogRecord) -> str:
        return redact_text(super().format(record))


def setup_logging(level: str | int = "INFO", fmt: str = FORMAT) -> None:
    """Log to stderr at ``level`` through a :class:`RedactingFormatter` (once per process; a later
    call sets the level and makes every root handler redact)."""
    level = level.upper() if isinstance(level, str) else level
    logging.basicConfig(level=level, stream=sys.stderr, format=fmt)
    root = logging.getLogger()
    root.setLevel(level)
    for handler in root.handlers:
        if not isinstance(handler.formatter, RedactingFormatter):
            handler.setFormatter(RedactingFormatter(handler.formatter._fmt if handler.formatter else fmt))


__all__ = ["FORMAT", "RedactingFormatter", "redact_text", "setup_logging"]
