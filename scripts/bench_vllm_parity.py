#!/usr/bin/env python
"""Serving parity: a draft's acceptance in the real vLLM against ``spectrain eval`` on the same prompts.

    python scripts/bench_vllm_parity.py [--quick] [--work DIR] [--vllm-venv DIR]

Builds hidden states of the tiny verifier vLLM serves (head_dim 32) with ``hsgen serve``, trains a
DFlash draft (bidirectional inside the block, and with ``--causal`` also a causal one) and an
Eagle3 draft with ``spectrain train`` (with ``--dspark`` also a DSpark draft: vLLM serves it only in
its V2 GPU runner, so that needs vLLM's CUDA build on a GPU), then serves each in vLLM (the CPU build,
``bash scripts/install_vllm.sh``, or a CUDA one) with ``--speculative-config`` naming the method and runs ``spectrain eval
--endpoint`` on held-out prompts: vLLM's tau from its spec-decode counters on ``/metrics``, ours
counted the same way, and every served output checked against greedy decoding. The last stdout
line is one JSON object (``dflash_vllm_tau``, ``dflash_spectrain_tau``, ``eagle3_vllm_tau``,
``eagle3_spectrain_tau``, ``exact_match``, ...); the exit status is non-zero when any part did not
measure.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAYERS = "1,2,3,4"
DRAFTS = {
    "dflash": ["--speculator-type", "dflash", "--block-size", "4", "--max-anchors", "64", "--num-layers", "1"],
    "dflash_causal": ["--speculator-type", "dflash", "--block-size", "4", "--max-anchors", "64", "--num-layers", "1",
                      "--block-attention", "causal"],
    "eagle3": ["--speculator-type", "eagle3", "--ttt-steps", "3"],
    "dspark": ["--speculator-type", "dspark", "--block-size", "4", "--max-anchors", "64", "--num-layers", "1",
               "--markov-rank", "64"],
}  # fmt: skip


def log(msg: str) -> None:
    print(f"[bench_vllm_parity] {msg}", file=sys.stderr, flush=True)


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(TOKENIZERS_PARALLELISM="false")
    return env


def _run(cmd: list[str], timeout: float, what: str) -> str:
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=_env())
    if r.returncode != 0:
        raise SystemExit(f"{what} failed (exit {r.returncode}):\n{r.stderr[-3000:]}")
    return r.stdout


def make_store(work: Path, model: Path, chats: Path) -> Path:
    from hsgen.serve.testing import running_server

    store = work / "store"
    if store.exists():
        return store
    with running_server(model, LAYERS, work / "hs", dtype="float32") as url:
        _run([sys.executable, "-m", "hsgen.cli", "generate", str(chats), "--store", str(store), "--endpoint", url,
              "--shared-dir", str(url.shared_dir), "--layer-ids", LAYERS, "--tokenizer", str(model),
              "--max-len", "1024", "--no-progress"], 900, "hsgen generate")  # fmt: skip
    return store


def train(work: Path, model: Path, store: Path, name: str, epochs: int) -> Path:
    save = work / f"draft-{name}"
    if not (save / "latest").is_file():
        _run([sys.executable, "-m", "spectrain.cli", "train", "--store", str(store), "--verifier", str(model),
              "--verifier-name", "hsgen/tiny-qwen3-vllm", *DRAFTS[name], "--save-path", str(save),
              "--epochs", str(epochs), "--total-seq-len", "1024", "--draft-vocab-size", "512", "--lr", "3e-3",
              "--val-fraction", "0", "--num-workers", "0", "--device", "cpu"], 1800, f"spectrain train {name}")  # fmt: skip
    return save / (save / "latest").read_text().strip()


def launch(draft: Path, model: Path, args, logs: Path):
    """A vLLM server for ``draft`` with the method its export names, started without waiting."""
    from hsgen.vllm.server import launch_server, speculative_args, vllm_python
    from spectrain.export.read import read_export_config
    from spectrain.export.write import speculative_config_for

    spec = speculative_config_for(draft, read_export_config(draft))
    env = {"VLLM_USE_V2_MODEL_RUNNER": "1"} if spec["method"] == "dspark" else None  # its only runner
    return launch_server(model, speculative_args(draft, spec["method"], spec["num_speculative_tokens"]),
                         python=vllm_python(args.vllm_venv), log_path=logs / f"vllm-{draft.parent.name}.log",
                         env=env)  # fmt: skip


def serve_and_eval(server, t0: float, draft: Path, model: Path, prompts: Path, args) -> dict:
    """Wait for ``server`` (launched at ``t0``), run ``spectrain eval --endpoint`` on it, stop it."""
    from hsgen.vllm.server import wait_healthy

    try:
        wait_healthy(server, max(1.0, args.startup_timeout - (time.monotonic() - t0)))
        startup = time.monotonic() - t0
        out = _run([sys.executable, "-m", "spectrain.cli", "eval", "--draft", str(draft), "--verifier", str(model),
                    "--prompts", str(prompts), "--max-new-tokens", str(args.max_new_tokens), "--endpoint", server.url,
                    "--ignore-eos", "--json", "--no-progress"], 1800,
                   f"spectrain eval --endpoint ({draft})")  # fmt: skip
    finally:
        server.stop()
    result = json.loads(out.strip().splitlines()[-1])
    result["vllm_startup_s"] = startup
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick", action="store_true", help="fewer chats, prompts and epochs (a few minutes)"
    )
    parser.add_argument("--work", type=Path, help="work directory (kept; reused: the store and drafts)")
    parser.add_argument("--vllm-venv", help="the vLLM venv [default: $VLLM_VENV or <repo>/.venv-vllm]")
    parser.add_argument("--causal", action="store_true", help="also a DFlash draft causal inside the block")
    parser.add_argument(
        "--dspark", action="store_true", help="also a DSpark draft (vLLM's CUDA build on a GPU)"
    )
    parser.add_argument("--train-chats", type=int)
    parser.add_argument("--prompts", type=int)
    parser.add_argument("--max-new-tokens", type=int)
    parser.add_argument("--startup-timeout", type=float, default=900.0)
    args = parser.parse_args()
    n_train = args.train_chats or (160 if args.quick else 480)
    n_prompts = args.prompts or (8 if args.quick else 32)
    args.max_new_tokens = args.max_new_tokens or (32 if args.quick else 64)
    epochs = 2 if args.quick else 3
    work = args.work or Path(tempfile.mkdtemp(prefix="bench-vllm-parity-"))
    work.mkdir(parents=True, exist_ok=True)

    from hsgen.hf.tiny import VLLM_SPEC, ensure_tiny_model
    from hsgen.inputs.sample_data import sample_chats_path
    from hsgen.vllm.server import vllm_python

    python = vllm_python(args.vllm_venv)  # fail now, not after training, when vLLM is not installed
    if args.dspark:
        from hsgen.vllm.command import probe_vllm

        if probe_vllm(str(python)).build == "cpu":
            raise SystemExit("--dspark: vLLM serves DSpark only in its V2 GPU runner; this is the CPU build "
                             f"({python}): run it where vLLM's CUDA build and a GPU are")  # fmt: skip
    model = ensure_tiny_model(spec=VLLM_SPEC)
    lines = sample_chats_path().read_text().splitlines()
    (work / "train.jsonl").write_text("\n".join(lines[:n_train]) + "\n")
    (work / "heldout.jsonl").write_text("\n".join(lines[-n_prompts:]) + "\n")  # never trained on
    log(f"store of {n_train} chats (hsgen serve) in {work}")
    store = make_store(work, model, work / "train.jsonl")
    names = (
        ["dflash", "eagle3"]
        + (["dflash_causal"] if args.causal else [])
        + (["dspark"] if args.dspark else [])
    )
    figures: dict = {"quick": args.quick, "train_chats": n_train, "prompts": n_prompts,
                     "max_new_tokens": args.max_new_tokens}  # fmt: skip
    drafts = {}
    for name in names:
        log(f"train {name}")
        drafts[name] = train(work, model, store, name, epochs)
    # Every server starts at once (a start is mostly single-threaded imports), then each is measured
    # alone: the counters are per server, so nothing else touches the one being measured.
    log(f"start {len(names)} vLLM servers side by side")
    t0 = time.monotonic()
    servers = {}
    try:
        for name in names:
            servers[name] = launch(drafts[name], model, args, work)
        exact = True
        for name in names:
            log(f"measure {name} served in vLLM")
            r = serve_and_eval(servers[name], t0, drafts[name], model, work / "heldout.jsonl", args)
            served = r["served"]
            figures[f"{name}_vllm_tau"] = round(served["tau"], 4)
            figures[f"{name}_spectrain_tau"] = round(r["tau"], 4)
            figures[f"{name}_vllm_acceptance"] = [round(x, 4) for x in served["acceptance_rate"]]
            figures[f"{name}_spectrain_acceptance"] = [round(x, 4) for x in r["acceptance_rate"]]
            figures[f"{name}_drafts"] = served["drafts"]
            figures[f"{name}_steps"] = r["steps"]
            figures[f"{name}_vllm_startup_s"] = round(r["vllm_startup_s"], 1)
            figures[f"{name}_block_attention"] = r.get("block_attention")
            exact = exact and bool(served["exact_match"]) and bool(r["exact_match"])
            log(
                f"{name}: vLLM tau {served['tau']:.4f}, spectrain tau {r['tau']:.4f}, exact {served['exact_match']}"
            )
    finally:
        for server in servers.values():
            server.stop()
    figures["exact_match"] = exact
    figures["max_tau_difference"] = round(
        max(abs(figures[f"{n}_vllm_tau"] - figures[f"{n}_spectrain_tau"]) for n in names), 4
    )
    (work / "figures.json").write_text(json.dumps(figures, indent=1) + "\n")
    print(json.dumps(figures))
    if not exact:
        sys.exit(1)


if __name__ == "__main__":
    main()
