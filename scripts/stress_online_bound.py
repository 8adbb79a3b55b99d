"""Stress the online scratch bound: does ``spectrain train --online --delete-consumed`` stay under it?

Runs the end-to-end test's command (30 sample chats, 2 epochs, a 3 MiB scratch bound, 512-token
sequences, a one-layer DFlash draft on CPU) ``--runs`` times, ``--parallel`` at a time, each
against its own reference server, so that the runs load the CPU the way a busy CI machine
does. A watcher thread polls each scratch directory's size every 10 ms.

Measured per run: the peak bytes held (the scratch directory, or the fetched samples held in memory
by the default read-once mode, ``held_peak_bytes``) and the trainer's ``overshoots`` counter (fetches past
the bound to escape a deadlock). Last stdout line: ``{"runs", "overshoot_runs", "peak_max_bytes",
"bound_bytes"}``; ``overshoot_runs`` counts runs that overshot by either measure.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

BOUND = 3 << 20
LAYERS = [1, 2, 4]


def _peak_watch(path: Path, stop: threading.Event, peak: list[int]) -> None:
    from spectrain.online import dir_bytes

    while not stop.is_set():
        if path.exists():
            peak[0] = max(peak[0], dir_bytes(path))
        time.sleep(0.01)


def one_run(model: Path, chats: list[str]) -> dict:
    """One training run against its own server; its peak scratch bytes and overshoots."""
    from hsgen.serve.testing import running_server

    with tempfile.TemporaryDirectory(prefix="stress-online-") as name:
        tmp = Path(name)
        (tmp / "p.jsonl").write_text("\n".join(chats) + "\n")
        with running_server(model, LAYERS, tmp / "hs") as url:
            cmd = [
                sys.executable, "-m", "spectrain.cli", "train", "--online", "--endpoint", url,
                "--prompts", str(tmp / "p.jsonl"), "--verifier", str(model), "--save-path", str(tmp / "save"),
                "--store", str(tmp / "store"), "--shared-dir", str(url.shared_dir),
                "--scratch-dir", str(tmp / "scratch"), "--scratch-bytes", str(BOUND),
                "--online-option", f"layer_ids={json.dumps(LAYERS)}", "--total-seq-len", "512",
                "--block-size", "4", "--num-layers", "1", "--max-anchors", "16", "--val-fraction", "0",
                "--log-every", "1", "--device", "cpu", "--epochs", "2", "--delete-consumed",
            ]  # fmt: skip
            env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
            stop, peak = threading.Event(), [0]
            watcher = threading.Thread(target=_peak_watch, args=(tmp / "scratch", stop, peak), daemon=True)
            watcher.start()
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
            stop.set()
            watcher.join()
        if proc.returncode != 0:
            raise RuntimeError(f"training failed ({proc.returncode}): {proc.stderr[-2000:]}")
        records = [json.loads(x) for x in (tmp / "save" / "metrics.jsonl").read_text().splitlines()]
        data = [r["data"] for r in records if "data" in r][-1]
        return {"peak": max(peak[0], data.get("held_peak_bytes", 0)), "overshoots": data["overshoots"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="4 runs, 4 at a time (about a minute on 2 cores)")
    ap.add_argument("--runs", type=int, default=24)
    ap.add_argument("--parallel", type=int, default=6, help="runs at a time")
    args = ap.parse_args()
    if args.quick:
        args.runs, args.parallel = 4, 4

    from hsgen.hf.tiny import ensure_tiny_model
    from hsgen.inputs.sample_data import sample_chats_path

    model = ensure_tiny_model()
    chats = Path(sample_chats_path()).read_text().splitlines()[:30]
    with concurrent.futures.ThreadPoolExecutor(args.parallel) as pool:
        results = list(pool.map(lambda _: one_run(model, chats), range(args.runs)))
    for i, r in enumerate(results):
        print(f"run {i}: peak {r['peak']} B, overshoots {r['overshoots']}", file=sys.stderr)
    print(
        json.dumps(
            {
                "runs": len(results),
                "overshoot_runs": sum(1 for r in results if r["overshoots"] or r["peak"] > BOUND),
                "peak_max_bytes": max(r["peak"] for r in results),
                "bound_bytes": BOUND,
            }
        )
    )


if __name__ == "__main__":
    main()
