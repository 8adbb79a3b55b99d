#!/usr/bin/env python
"""One JSON object from a run_all.sh work directory: our figures, the peer's, and the ratios.

    python scripts/gpu/summarize.py WORKDIR [--out DIR] > summary.json
    python scripts/gpu/summarize.py WORKDIR --record NAME --rc RC --seconds S --bound B [FILE]

Reads ``WORKDIR/logs``: ``ours-dflash.json``, ``ours-eagle3.json``, ``ours-dspark.json`` (or one ``ours.json``) and
``ours-compiled-*.json`` (bench_train.py's last complete JSON line, eager and ``--compile on``;
a part cut by its bound leaves the line of what it finished), ``peer/results.jsonl`` (the peer's bench, one object per model),
``train-metrics.jsonl`` (spectrain train's per-step records; the first two steps are warm-up and
not counted), ``serve.json``, ``multi.json`` (multi_rank.sh: torchrun's exit codes), ``vllm.json`` (bench_vllm_parity.py), ``loader.json`` and ``online.json`` (the data path benchmarks), and
``parts.jsonl`` (how each part of run_all.sh ended: ``parts``). Missing parts are null; the ratios
are ours / the peer's from the same run, and compiled / eager for ``*_compile_speedup``.

``--record`` appends one part's line to ``parts.jsonl`` (its exit status or ``skipped`` /
``interrupted``, seconds, bound, and FILE's last JSON line); ``--out DIR`` writes ``summary.json``
and a copy of ``parts.jsonl`` into DIR, each replaced atomically, instead of printing (after the
record, with both).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path


def _objects(path: Path) -> list[dict]:
    """The JSON objects among ``path``'s lines (a line cut by a kill is not one)."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return []
    out = []
    for line in text.splitlines():
        if line.strip().startswith("{"):
            try:
                obj = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(obj, dict):
                out.append(obj)
    return out


def _last_json(path: Path) -> dict | None:
    objs = _objects(path)
    return objs[-1] if objs else None


_jsonl = _objects


def _merged(paths: list[Path]) -> dict:
    """One bench_train.py result from several processes' (one per draft); ``parts_done`` joined."""
    out: dict = {}
    done: list[str] = []
    for p in paths:
        r = _last_json(p) or {}
        done += r.get("parts_done", [])
        out.update(r)
    if done:
        out["parts_done"] = done
    return out


MODELS = ("dflash", "eagle3", "dspark")


def _ratio(a, b) -> float | None:
    return round(a / b, 3) if isinstance(a, int | float) and isinstance(b, int | float) and b else None


def summarize(work: Path) -> dict:
    logs = work / "logs"
    ours = _merged([logs / "ours.json", *(logs / f"ours-{m}.json" for m in MODELS)])
    compiled = _merged([logs / "ours-compiled.json", *(logs / f"ours-compiled-{m}.json" for m in MODELS)])
    peer = {r.get("model"): r for r in _jsonl(logs / "peer" / "results.jsonl")}
    out: dict = {"device": ours.get("device") or compiled.get("device"), "ours": ours or None,
                 "ours_compiled": compiled or None, "peer": {}}  # fmt: skip
    for name in MODELS:  # the peer's benchmark times DFlash and Eagle3: DSpark's peer figures stay None
        p = peer.get(name) or {}
        out["peer"][name] = {k: p.get(k) for k in ("ok", "step_s_median", "tokens_per_s", "tflops_achieved",
                                                   "peak_mem_alloc_gib", "error") if k in p} or None  # fmt: skip
        out[f"{name}_tokens_per_s"] = ours.get(f"{name}_tokens_per_s")
        out[f"{name}_peak_gib"] = ours.get(f"{name}_peak_gib")
        out[f"peer_{name}_tokens_per_s"] = p.get("tokens_per_s")
        out[f"peer_{name}_peak_gib"] = p.get("peak_mem_alloc_gib")
        out[f"{name}_speed_ratio"] = _ratio(ours.get(f"{name}_tokens_per_s"), p.get("tokens_per_s"))
        out[f"{name}_memory_ratio"] = _ratio(ours.get(f"{name}_peak_gib"), p.get("peak_mem_alloc_gib"))
        fast = compiled.get(f"{name}_tokens_per_s_compiled")
        out[f"{name}_tokens_per_s_compiled"] = fast
        out[f"{name}_peak_gib_compiled"] = compiled.get(f"{name}_peak_gib_compiled")
        out[f"{name}_compile_s"] = compiled.get(f"{name}_first_step_s_compiled")
        out[f"{name}_compile_speedup"] = _ratio(fast, ours.get(f"{name}_tokens_per_s"))
        out[f"{name}_compiled_speed_ratio"] = _ratio(fast, p.get("tokens_per_s"))
        out[f"{name}_sync_free"] = ours.get(f"{name}_sync_free")
        out[f"{name}_sync_free_compiled"] = compiled.get(f"{name}_sync_free")
    steps = [r for r in _jsonl(logs / "train-metrics.jsonl") if r.get("split") == "train"]
    timed = steps[2:] or steps
    out["train"] = {
        "steps": len(steps),
        "tokens_per_s_median": round(statistics.median(r["tokens_per_s"] for r in timed), 1) if timed else None,
        "data_wait_fraction_median": round(statistics.median(r["data_wait_fraction"] for r in timed), 4)
        if timed else None,
    }  # fmt: skip
    out["serve"] = _last_json(logs / "serve.json")
    out["multi"] = _last_json(logs / "multi.json")  # torchrun's exit codes and checkpoints (issue 30)
    out["vllm"] = _last_json(logs / "vllm.json")  # served acceptance against spectrain eval (DSpark included)
    loader = _last_json(logs / "loader.json") or {}
    online = _last_json(logs / "online.json") or {}
    out["data_path"] = {
        **{k: loader.get(k) for k in ("loader_gbps", "loader_ratio", "raw_gbps")},
        **{
            k: online.get(k) for k in ("online_gbps", "online_ratio", "online_raw_gbps", "real_wait_fraction")
        },
    }
    out["parts"] = {
        r["part"]: {k: r.get(k) for k in ("rc", "seconds", "bound")} for r in _jsonl(logs / "parts.jsonl")
    }
    return out


def _replace(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _status(rc: str) -> int | str:
    return int(rc) if rc.lstrip("-").isdigit() else rc


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("work", type=Path)
    ap.add_argument("--out", type=Path, help="write summary.json and parts.jsonl here (atomically)")
    ap.add_argument("--record", metavar="NAME", help="append part NAME's line to logs/parts.jsonl")
    ap.add_argument("--rc", default="")
    ap.add_argument("--seconds", type=int, default=0)
    ap.add_argument("--bound", type=int, default=0)
    ap.add_argument("files", nargs="*", type=Path, help="--record: the part's JSON output")
    args = ap.parse_intermixed_args()
    logs = args.work / "logs"
    if args.record:
        rec = {"part": args.record, "rc": _status(args.rc), "seconds": args.seconds, "bound": args.bound,
               "result": _merged(args.files) or None}  # fmt: skip
        logs.mkdir(parents=True, exist_ok=True)
        with open(logs / "parts.jsonl", "a") as f:
            f.write(json.dumps(rec) + "\n")
        if args.out is None:
            return
    text = json.dumps(summarize(args.work))
    if args.out is None:
        print(text)
        return
    args.out.mkdir(parents=True, exist_ok=True)
    _replace(args.out / "summary.json", text + "\n")
    parts = logs / "parts.jsonl"
    if parts.exists():
        _replace(args.out / "parts.jsonl", parts.read_text())


if __name__ == "__main__":
    main()
