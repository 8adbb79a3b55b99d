"""Build the sample chat dataset that ships with hsgen (``hsgen/data/sample_chats.jsonl``).

The conversations are questions about the Python standard library answered from its own
docstrings: real English text, present offline on every machine, no download. The output is
committed; rerun this only to change the dataset.

    python scripts/make_sample_data.py [--out PATH] [--limit N]
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import random
from pathlib import Path

MODULES = [
    "json",
    "os.path",
    "collections",
    "itertools",
    "functools",
    "textwrap",
    "string",
    "re",
    "math",
    "statistics",
    "heapq",
    "bisect",
    "shutil",
    "pathlib",
    "datetime",
    "calendar",
    "random",
    "fractions",
    "decimal",
    "csv",
    "base64",
    "hashlib",
    "zlib",
    "gzip",
    "tarfile",
    "zipfile",
    "glob",
    "fnmatch",
    "tempfile",
    "subprocess",
    "threading",
    "queue",
    "asyncio",
    "logging",
    "argparse",
    "unittest",
    "difflib",
    "pprint",
    "copy",
    "enum",
    "dataclasses",
    "typing",
    "contextlib",
    "operator",
    "uuid",
    "urllib.parse",
    "html",
    "socket",
    "struct",
    "array",
    "weakref",
    "inspect",
    "ast",
    "tokenize",
]
QUESTIONS = [
    "What does `{name}` do?",
    "Explain `{name}` from the Python standard library.",
    "How do I use `{name}`?",
    "Can you describe `{name}` briefly?",
    "I found `{name}` in some code. What is it for?",
]
FOLLOW_UPS = ["What is its signature?", "How would I call it?", "Which module is it in?"]
SYSTEMS = ["You are a helpful assistant.", "You are a concise Python expert.", None, None]


def _first_paragraphs(doc: str, max_chars: int = 900) -> str:
    paragraphs = [p.strip() for p in inspect.cleandoc(doc).split("\n\n") if p.strip()]
    text = ""
    for p in paragraphs:
        if len(text) + len(p) > max_chars and text:
            break
        text = f"{text}\n\n{p}" if text else p
    return text


def _entries():
    for mod_name in MODULES:
        module = importlib.import_module(mod_name)
        for attr in sorted(dir(module)):
            if attr.startswith("_"):
                continue
            obj = getattr(module, attr)
            if not (inspect.isfunction(obj) or inspect.isclass(obj) or inspect.isbuiltin(obj)):
                continue
            doc = inspect.getdoc(obj)
            if not doc or len(doc) < 40:
                continue
            try:
                sig = str(inspect.signature(obj))
            except (TypeError, ValueError):
                sig = "(...)"
            yield mod_name, attr, sig, _first_paragraphs(doc)


def build(limit: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    entries = list(_entries())
    rng.shuffle(entries)
    rows = []
    for i, (mod_name, attr, sig, doc) in enumerate(entries[:limit]):
        name = f"{mod_name}.{attr}"
        messages = []
        system = rng.choice(SYSTEMS)
        if system:
            messages.append({"role": "system", "content": system})
        messages.append({"role": "user", "content": rng.choice(QUESTIONS).format(name=name)})
        messages.append({"role": "assistant", "content": f"`{name}{sig}`\n\n{doc}"})
        if rng.random() < 0.35:
            follow = rng.choice(FOLLOW_UPS)
            messages.append({"role": "user", "content": follow})
            if follow.startswith("Which module"):
                answer = f"It lives in the `{mod_name}` module: `from {mod_name} import {attr}`."
            else:
                answer = f"Call it as `{name}{sig}`."
            messages.append({"role": "assistant", "content": answer})
        rows.append({"id": f"stdlib-{i:05d}", "messages": messages})
    return rows


def main() -> None:
    default_out = Path(__file__).resolve().parents[1] / "packages/hsgen/src/hsgen/data/sample_chats.jsonl"
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=default_out)
    parser.add_argument("--limit", type=int, default=1200)
    args = parser.parse_args()
    rows = build(args.limit)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("w") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    print(json.dumps({"conversations": len(rows), "path": str(args.out)}))


if __name__ == "__main__":
    main()
