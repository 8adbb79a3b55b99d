"""The runnable parts of the Markdown docs: fenced ```` ```bash runnable ```` blocks, each optionally
followed by a ```` ```text output ```` block of what it prints.

Every line of an output block must match a line of the block's stdout, in order; ``...`` inside
a line stands for any text, and a line that is only ``...`` marks lines left out.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

_FENCE = re.compile(r"^```(\w*)[ \t]*(.*)$")


@dataclass
class Block:
    doc: str
    line: int
    code: str
    expected: list[str] | None = None

    @property
    def where(self) -> str:
        return f"{self.doc}:{self.line}"


def blocks(path: Path) -> list[Block]:
    """The runnable blocks of one Markdown file, each with the output block that comes next (prose
    may stand between them; another fenced block may not)."""
    out: list[Block] = []
    lines = path.read_text().splitlines()
    last: Block | None = None
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        lang, info, start = m.group(1), m.group(2).split(), i
        body = []
        i += 1
        while i < len(lines) and not lines[i].startswith("```"):
            body.append(lines[i])
            i += 1
        i += 1
        if lang == "bash" and "runnable" in info:
            last = Block(path.name, start + 1, "\n".join(body))
            out.append(last)
        elif lang == "text" and "output" in info:
            if last is None or last.expected is not None:
                raise ValueError(f"{path.name}:{start + 1}: an output block must follow a runnable block")
            last.expected = body
            last = None
        else:
            last = None
    return out


def match_output(expected: list[str], actual: str) -> str | None:
    """None when every expected line matches an actual line in order, else the first that does not."""
    got = [line.rstrip() for line in actual.splitlines()]
    pos = 0
    for want in expected:
        if not want.strip() or want.strip() == "...":
            continue
        pattern = re.compile(".*".join(re.escape(part) for part in want.rstrip().split("...")))
        while pos < len(got) and not pattern.fullmatch(got[pos]):
            pos += 1
        if pos == len(got):
            return want
        pos += 1
    return None
