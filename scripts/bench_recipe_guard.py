#!/usr/bin/env python
"""Recipe guard: today's DFlash and Eagle3 recipes, trained and evaluated, against the figure recorded
for the same inputs; fails when either fell.

Runs ``bench_quality.py --size guard`` (the smallest size that separates today's recipe from a
broken one: docs/benchmarks.md, "The recipe guard") with our two trained drafts, then compares each
tau with ``scripts/quality_recorded.json``:

- a record for the same input hashes (target weights, ``train.jsonl``, ``eval.jsonl``: the same
  target, data and prompts, so the same computation): each tau must be at least
  :data:`SAME_INPUTS` of the recorded one;
- no record for these hashes (another kernel set, library version or corpus built another target):
  the guard says which hashes differ and falls back to the size's record on other inputs, with the
  looser floor :data:`OTHER_INPUTS` (docs/decisions.md, issue 31).

``--train-args`` passes flags to ``spectrain train`` (break the recipe on purpose: ``--train-args
'--lr 1e-7'`` must fail); ``--record`` writes this run's figures as the record for its hashes
(after a deliberate recipe change, with the default-size comparison that justifies it). The last
stdout line is JSON: both taus, the floors, ``inputs_recorded``, ``passed`` and the hashes; exit
status 1 when a tau is under its floor or an output differed from greedy decoding. ``--quick`` is
the same run (it is already the smallest that measures anything).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import logging
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
RECORD = HERE / "quality_recorded.json"
SIZE = "guard"
ALGORITHMS = ("dflash", "eagle3")
HASHES = ("target_weights_sha256", "train_jsonl_sha256", "eval_jsonl_sha256")
SAME_INPUTS = 0.9
"""Floor with a record for the same inputs (the same computation, so any change is the code's):
soft targets alone take Eagle3 to 71% and DFlash to 88% of today's, the old recipe or no training
to 27-45% (docs/benchmarks.md, "The recipe guard")."""
OTHER_INPUTS = 0.7
"""Floor against the size's record on other inputs: another target of the same spec moves tau more."""


def _records() -> list[dict]:
    return json.loads(RECORD.read_text()).get(SIZE, []) if RECORD.is_file() else []


def _judge(figures: dict, records: list[dict]) -> dict:
    """The floors for this run's figures and whether they hold."""
    inputs = {k: figures[k] for k in HASHES}
    same = next((r for r in records if r["inputs"] == inputs), None)
    ref, share = (same, SAME_INPUTS) if same else ((records or [None])[-1], OTHER_INPUTS)
    if ref is None:
        raise SystemExit(f"{RECORD}: no recorded figure for the {SIZE} size; run with --record once")
    if not same:
        differ = [k for k in HASHES if ref["inputs"][k] != inputs[k]]
        print(f"guard: no record for these inputs ({', '.join(differ)} differ from the record of "
              f"{ref.get('recorded')}); floor {100 * OTHER_INPUTS:.0f}% of it", file=sys.stderr)  # fmt: skip
    floors = {a: round(share * ref[f"tau_{a}"], 4) for a in ALGORITHMS}
    failed = [a for a in ALGORITHMS if figures[f"tau_{a}"] < floors[a]]
    for a in ALGORITHMS:
        verdict = "FELL" if a in failed else "ok"
        print(f"guard: {a} tau {figures[f'tau_{a}']:.4f}, recorded {ref[f'tau_{a}']:.4f}, floor {floors[a]:.4f}: "
              f"{verdict}", file=sys.stderr)  # fmt: skip
    return {"inputs_recorded": bool(same), "recorded": {a: ref[f"tau_{a}"] for a in ALGORITHMS},
            "floors": floors, "fell": failed}  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--quick", action="store_true", help="The same run (the guard size is already the smallest)."
    )
    ap.add_argument("--train-args", default="", help="Extra `spectrain train` flags (e.g. a broken recipe).")
    ap.add_argument("--record", action="store_true", help="Record this run's figures for its input hashes.")
    ap.add_argument(
        "--cache", default=None, help="Where trained targets are kept (bench_quality.py's --cache)."
    )
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s: %(message)s")
    import bench_quality

    argv = ["--size", SIZE, "--drafts", ",".join(ALGORITHMS), "--train-args", args.train_args]
    argv += ["--cache", args.cache] if args.cache else []
    t0 = time.perf_counter()
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = bench_quality.main(argv)
    figures = json.loads(out.getvalue().strip().splitlines()[-1])
    if args.record:
        from quality_inputs import build_key, environment

        records = [r for r in _records() if r["inputs"] != {k: figures[k] for k in HASHES}]
        records.append({"inputs": {k: figures[k] for k in HASHES}, "recorded": time.strftime("%Y-%m-%d"),
                        "build": build_key(environment("cpu")), "train_args": args.train_args,
                        **{f"tau_{a}": figures[f"tau_{a}"] for a in ALGORITHMS}})  # fmt: skip
        book = json.loads(RECORD.read_text()) if RECORD.is_file() else {}
        book[SIZE] = records
        RECORD.write_text(json.dumps(book, indent=2) + "\n")
        print(
            f"guard: recorded { ({a: figures[f'tau_{a}'] for a in ALGORITHMS}) } in {RECORD}", file=sys.stderr
        )
    verdict = _judge(figures, _records())
    passed = code == 0 and figures["exact_match"] and not verdict["fell"]
    print(json.dumps({**{f"tau_{a}": figures[f"tau_{a}"] for a in ALGORITHMS}, **verdict, "passed": passed,
                      "exact_match": figures["exact_match"], "train_args": args.train_args,
                      "seconds": round(time.perf_counter() - t0, 1), **{k: figures[k] for k in HASHES}}))  # fmt: skip
    if not passed:
        print(f"recipe guard FAILED: {', '.join(verdict['fell']) or 'an output differed from greedy decoding'} "
              f"under the floor {verdict['floors']}", file=sys.stderr)  # fmt: skip
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
