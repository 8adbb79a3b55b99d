#!/usr/bin/env python
"""Bytes on disk against acceptance: the store layouts side by side on the quality benchmark's data.

The quality benchmark's target, prompts and draft recipes (``scripts/quality_*.py``, its
``small`` size, the former ``quick``: the target is shared with it and cached) are run through
``hsgen serve`` in bfloat16 (the dtype vLLM serves) and ``hsgen generate`` into four stores:

- ``raw``: every captured layer (the drafts' input layers and the verifier's final layer), bf16;
- ``fp8``: the same layers, e4m3 with a per-token scale (``--codec fp8``);
- ``argmax``: the input layers only, and the verifier's greedy next token per position from vLLM's
  ``prompt_logprobs`` (``--targets argmax``);
- ``fp8_argmax``: both.

Bytes per token are every byte of each store (header, manifests, shards) over its tokens,
against the peer's layout: speculators keeps vLLM's file for each sample (``hs_<i>.safetensors``:
``hidden_states [T, layers, H]`` bf16 of every captured layer, ``token_ids [T]`` int64), whose
size is computed exactly with ``safetensors`` for each sample's length. DFlash and Eagle3 are
trained on each store with the same seed, data order and budget (a paired comparison) and
measured with ``spectrain eval`` (speculative decoding checked token for token against greedy
decoding) on ``--eval-prompts`` held-out prompts: 24 by default, three times the quality
benchmark's 8, so that one verification step more or less moves tau by under 0.5%. Each layout
is generated through its own real path (``--codec``, ``--targets argmax`` with vLLM's
``prompt_logprobs``) rather than derived from the raw store: a generation takes seconds, the
trainings are the cost. Each row also reports how far its trained weights are from ``raw``'s
(``weights_max_diff_*``), which shows the layouts did train on different data.

The last stdout line is JSON: ``bytes_per_token_ratio`` (the recommended layout, ``fp8_argmax``,
against the peer), ``tau_delta_dflash`` and ``tau_delta_eagle3`` (relative, recommended against
``raw``), ``exact_match``, and per layout its bytes, ratio and taus. Exit status 1 when anything
it reports was not measured or an output differed from greedy decoding.
``--bytes-only`` builds the stores and reports their bytes alone (no tau, nothing else claimed).
``--quick`` (the quality benchmark's quick size: a tiny target, 32 prompts, 4 eval prompts, every
command in this process; layouts ``raw`` and ``fp8_argmax``) checks the whole path in under a
minute; the default (the ``small`` size, 8 trainings, 8 evaluations) took 19 minutes with
``--eval-prompts 8`` at load 2-8 and 49 with the default 24 at load 13-24 on the shared
2-core VM.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import quality_steps as steps  # noqa: E402  (the quality benchmark's prompts, generation, training, eval)
from quality_sizes import SIZES, draft_layers  # noqa: E402
from quality_target import ensure_target  # noqa: E402

log = logging.getLogger("bench_storage")

LAYOUTS = {"raw": ("raw", "states"), "fp8_argmax": ("fp8", "argmax"), "fp8": ("fp8", "states"),
           "argmax": ("raw", "argmax")}  # fmt: skip
"""Layout -> (``--codec``, ``--targets``), in the order they run: ``raw`` (the reference) first,
then the recommended layout, so that a run cut short has the comparison that decides."""

RECOMMENDED = "fp8_argmax"


def store_bytes(store: Path) -> int:
    """Every byte of a store's data: header, manifests, shards (leases are not data)."""
    total = (store / "hsgen-store.json").stat().st_size
    for sub in ("manifests", "shards"):
        for root, _, files in os.walk(store / sub):
            total += sum(os.stat(os.path.join(root, f)).st_size for f in files)
    return total


def peer_bytes(lengths: list[int], layers: int, hidden: int) -> int:
    """Bytes of speculators' files for samples of ``lengths``: vLLM's safetensors file per sample
    (bf16 ``hidden_states [T, layers, H]``, int64 ``token_ids [T]``), sized by safetensors itself."""
    import torch
    from safetensors.torch import save

    sizes: dict[int, int] = {}
    for T in set(lengths):
        tensors = {"hidden_states": torch.zeros(T, layers, hidden, dtype=torch.bfloat16),
                   "token_ids": torch.zeros(T, dtype=torch.int64)}  # fmt: skip
        sizes[T] = len(save(tensors))
    return sum(sizes[T] for T in lengths)


def weights_max_diff(reference: Path, draft: Path) -> float:
    """The largest absolute difference between two exported drafts' weights (0.0: the same draft)."""
    from safetensors.torch import load_file

    a, b = load_file(reference / "model.safetensors"), load_file(draft / "model.safetensors")
    if a.keys() != b.keys():
        raise SystemExit(f"{draft} and {reference} hold different tensors")
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


def targets_differing(raw: Path, store: Path, target: Path) -> tuple[int, int]:
    """Trained positions (loss mask 1) where an argmax store's target, vLLM's ``prompt_logprobs``
    top token from the bf16 server, differs from the trainer's target formed from the raw store's
    final layer (the verifier's norm and head in float32): (differing, trained positions)."""
    import torch

    from hsgen.store import HiddenStateStore
    from spectrain.data.batch import storage_to_torch
    from spectrain.models.verifier import VerifierHeads

    heads = VerifierHeads.load(target)
    states, ids = HiddenStateStore.open(raw), HiddenStateStore.open(store)
    differ = trained = 0
    for sid in states.sample_ids():
        a, b = states.read(sid), ids.read(sid)
        final = storage_to_torch(a.hidden_states, a.dtype)[:, -1].float()
        with torch.no_grad():
            mine = heads.logits(heads.norm(final)).argmax(-1).numpy()
        mask = a.loss_mask.astype(bool)
        differ += int(((mine != b.target_ids) & mask).sum())
        trained += int(mask.sum())
    return differ, trained


def generate_store(target: Path, train_jsonl: Path, layers: list[int], store: Path, shared: Path,
                   codec: str, targets: str, in_process: bool) -> None:  # fmt: skip
    from hsgen.serve.testing import running_server

    with running_server(target, layers, shared, mode="thread" if in_process else "process", dtype="bfloat16",
                        torch_threads=steps.torch_threads()) as url:  # fmt: skip
        summary = steps.run(
            steps.hsgen_cmd(
                "generate", str(train_jsonl), "--store", str(store), "--endpoint", url, "--shared-dir", str(shared),
                "--layer-ids", ",".join(map(str, layers)), "--verifier", "bench/stdlib-target", "--codec", codec,
                "--targets", targets, "--log-level", "warning", "--no-progress",
            ),
            f"hsgen generate ({store.name})",
        )  # fmt: skip
    stored = json.loads(summary)
    if stored.get("failed"):
        raise SystemExit(f"hsgen generate into {store} failed for {stored['failed']} prompts: {summary}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--quick",
        action="store_true",
        help="The quality benchmark's quick size, layouts raw and fp8_argmax: under a minute.",
    )
    parser.add_argument(
        "--work", type=Path, default=None, help="Working directory (default: a temporary one)."
    )
    parser.add_argument("--keep", action="store_true", help="Keep the working directory.")
    parser.add_argument(
        "--cache", type=Path, default=None, help="Trained targets (default: bench_quality's)."
    )
    parser.add_argument("--threads", type=int, default=1, help="Torch threads of every step.")
    parser.add_argument(
        "--layouts", default=None, help="Layouts to run (default: all four; --quick raw,fp8_argmax)."
    )
    parser.add_argument(
        "--eval-prompts",
        type=int,
        default=None,
        help="Held-out prompts of each evaluation (default 24; --quick 4).",
    )
    parser.add_argument(
        "--bytes-only",
        action="store_true",
        help="Build the stores and report bytes per token only (no training).",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s: %(message)s")

    import torch

    from hsgen.hf.tiny import default_cache_dir
    from hsgen.store import HiddenStateStore

    torch.set_num_threads(max(1, args.threads))
    os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = str(max(1, args.threads))
    size = SIZES["quick" if args.quick else "small"]
    eval_prompts = args.eval_prompts or (size.num_eval_prompts if args.quick else 24)
    if eval_prompts < 1:
        raise SystemExit(f"--eval-prompts must be at least 1, got {args.eval_prompts}")
    size = dataclasses.replace(size, num_eval_prompts=eval_prompts)
    if args.layouts is None:  # --quick: the comparison that decides (the recommended layout against raw)
        args.layouts = f"raw,{RECOMMENDED}" if args.quick else ",".join(LAYOUTS)
    asked = [name.strip() for name in args.layouts.split(",") if name.strip()]
    if "raw" not in asked or any(name not in LAYOUTS for name in asked):
        raise SystemExit(f"--layouts must name 'raw' and some of {list(LAYOUTS)}, got {args.layouts!r}")
    layouts = [name for name in LAYOUTS if name in asked]  # raw first: the others are compared with it
    work = args.work or Path(tempfile.mkdtemp(prefix="bench-storage-"))
    work.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    try:
        target = ensure_target(args.cache or default_cache_dir() / "bench-quality", size.target, "cpu")
        train_jsonl, eval_jsonl = steps.make_prompts(target, size, work, "cpu")
        L = size.target.num_hidden_layers
        dflash_aux, eagle_aux = draft_layers(L)
        aux = sorted({*dflash_aux, *eagle_aux})
        results: dict[str, dict] = {}
        for name in layouts:
            codec, targets = LAYOUTS[name]
            store = work / f"store-{name}"
            layers = aux if targets == "argmax" else [*aux, L]
            if not (store / "hsgen-store.json").exists():
                generate_store(
                    target,
                    train_jsonl,
                    layers,
                    store,
                    work / f"server-files-{name}",
                    codec,
                    targets,
                    size.in_process,
                )
            opened = HiddenStateStore.open(store)
            ids = opened.sample_ids()
            lengths = [opened.record(s).length for s in ids]
            tokens = sum(lengths)
            peer = peer_bytes(lengths, len(aux) + 1, opened.header.hidden_size)
            ours = store_bytes(store)
            row = {"codec": codec, "targets": targets, "layers": layers, "samples": len(ids), "tokens": tokens,
                   "bytes_per_token": round(ours / tokens, 2), "peer_bytes_per_token": round(peer / tokens, 2),
                   "ratio": round(ours / peer, 4)}  # fmt: skip
            if targets == "argmax" and name != "raw":
                row["targets_differing"], row["trained_positions"] = targets_differing(
                    work / "store-raw", store, target
                )
            for algorithm in () if args.bytes_only else ("dflash", "eagle3"):
                draft_aux = dflash_aux if algorithm == "dflash" else eagle_aux
                draft, summary = steps.train_draft(
                    algorithm, size, target, store, draft_aux, work, "cpu", [], name
                )
                ev = steps.evaluate_draft(draft, target, eval_jsonl, size, "cpu")
                row[f"tau_{algorithm}"] = round(ev["tau"], 4)
                row[f"exact_{algorithm}"] = bool(ev["exact_match"])
                row[f"eval_steps_{algorithm}"] = ev["steps"]
                row[f"eval_tokens_{algorithm}"] = ev["new_tokens"]
                row[f"train_s_{algorithm}"] = summary.get("train_seconds")
                row[f"weights_max_diff_{algorithm}"] = weights_max_diff(
                    work / f"draft-{algorithm}-raw", draft
                )
            results[name] = row
            log.info("%s: %s", name, json.dumps(row))
            (work / "results-storage.json").write_text(json.dumps(results, indent=2) + "\n")
        if args.bytes_only:
            final_bytes = {"bytes_per_token_ratio": results[RECOMMENDED]["ratio"] if RECOMMENDED in results else None,
                           **{f"ratio_{n}": r["ratio"] for n, r in results.items()},
                           **{f"bytes_per_token_{n}": r["bytes_per_token"] for n, r in results.items()},
                           "peer_bytes_per_token": results["raw"]["peer_bytes_per_token"],
                           **{f"targets_differing_{n}": r["targets_differing"] for n, r in results.items()
                              if "targets_differing" in r}}  # fmt: skip
            print(json.dumps(final_bytes))
            return 0
        raw = results["raw"]
        for row in results.values():
            for algorithm in ("dflash", "eagle3"):
                row[f"tau_delta_{algorithm}"] = round(
                    row[f"tau_{algorithm}"] / raw[f"tau_{algorithm}"] - 1, 4
                )
        print(
            json.dumps({"layouts": results, "seconds": round(time.perf_counter() - t_start)}, indent=2),
            file=sys.stderr,
        )
        for name, row in results.items():
            print(f"{name:>11}: {row['bytes_per_token']:>8} B/token  {row['ratio']:.3f}x peer  "
                  f"tau dflash {row['tau_dflash']:.3f} ({row['tau_delta_dflash']:+.2%})  "
                  f"eagle3 {row['tau_eagle3']:.3f} ({row['tau_delta_eagle3']:+.2%})", file=sys.stderr)  # fmt: skip
        exact = all(row[f"exact_{a}"] for row in results.values() for a in ("dflash", "eagle3"))
        rec = results.get(RECOMMENDED)
        final = {
            "recommended": RECOMMENDED if rec else None,
            "bytes_per_token_ratio": rec["ratio"] if rec else None,
            "tau_delta_dflash": rec["tau_delta_dflash"] if rec else None,
            "tau_delta_eagle3": rec["tau_delta_eagle3"] if rec else None,
            "exact_match": exact,
            **{f"ratio_{n}": r["ratio"] for n, r in results.items()},
            **{
                f"tau_delta_{a}_{n}": r[f"tau_delta_{a}"]
                for n, r in results.items()
                if n != "raw"
                for a in ("dflash", "eagle3")
            },  # fmt: skip
        }
        print(json.dumps(final))
        return 0 if exact and rec is not None else 1
    finally:
        if args.work is None and not args.keep:
            shutil.rmtree(work, ignore_errors=True)
        else:
            log.info("kept %s", work)


if __name__ == "__main__":
    sys.exit(main())
