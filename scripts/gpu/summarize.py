#!/usr/bin/env python
"""One JSON object from a run_all.sh work directory: our figures, the peer's, and the ratios.

    python scripts/gpu/summarize.py WORKDIR > summary.json

Reads ``WORKDIR/logs``: ``ours.json`` and ``ours-compiled.json`` (bench_train.py's last line,
eager and ``--compile on``), ``peer/results.jsonl`` (the peer's bench, one object per model),
``train-metrics.jsonl`` (spectrain train's per-step records; the first two steps are warm-up and
not counted), ``serve.json``, ``loader.json`` and ``online.json`` (the data path benchmarks). Missing
parts are null; the ratios are ours / the peer's from the same run, and compiled / eager for
``*_compile_speedup``.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path


def _last_json(path: Path) -> dict | None:
    try:
        lines = [x for x in path.read_text().splitlines() if x.strip().startswith("{")]
        return json.loads(lines[-1]) if lines else None
    except (OSError, json.JSONDecodeError):
        return None


def _jsonl(path: Path) -> list[dict]:
    try:
        return [json.loads(x) for x in path.read_text().splitlines() if x.strip().startswith("{")]
    except (OSError, json.JSONDecodeError):
        return []


def _ratio(a, b) -> float | None:
    return round(a / b, 3) if isinstance(a, int | float) and isinstance(b, int | float) and b else None


def summarize(work: Path) -> dict:
    logs = work / "logs"
    ours = _last_json(logs / "ours.json") or {}
    compiled = _last_json(logs / "ours-compiled.json") or {}
    peer = {r.get("model"): r for r in _jsonl(logs / "peer" / "results.jsonl")}
    out: dict = {"device": ours.get("device") or compiled.get("device"), "ours": ours or None,
                 "ours_compiled": compiled or None, "peer": {}}  # fmt: skip
    for name in ("dflash", "eagle3"):
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
    loader = _last_json(logs / "loader.json") or {}
    online = _last_json(logs / "online.json") or {}
    out["data_path"] = {
        **{k: loader.get(k) for k in ("loader_gbps", "loader_ratio", "raw_gbps")},
        **{
            k: online.get(k) for k in ("online_gbps", "online_ratio", "online_raw_gbps", "real_wait_fraction")
        },
    }
    return out


def main() -> None:
    if len(sys.argv) != 2:
        sys.exit("usage: summarize.py WORKDIR")
    print(json.dumps(summarize(Path(sys.argv[1]))))


if __name__ == "__main__":
    main()
