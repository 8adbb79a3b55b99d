"""Build the HTML API reference of hsgen and spectrain from their docstrings (pdoc).

    python scripts/build_api_docs.py [--out docs/api]

Open ``docs/api/index.html`` afterwards. Needs the ``dev`` extra (pdoc).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pdoc

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "api")
    args = parser.parse_args()
    pdoc.render.configure(docformat="google", footer_text="hsgen + spectrain")
    pdoc.pdoc("hsgen", "spectrain", output_directory=args.out)
    pages = sorted(p.relative_to(args.out).as_posix() for p in args.out.rglob("*.html"))
    print(f"wrote {len(pages)} pages to {args.out}", file=sys.stderr)
    print(json.dumps({"out": str(args.out), "pages": len(pages)}))


if __name__ == "__main__":
    main()
