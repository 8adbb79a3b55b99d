"""The quality benchmark's steps: prompts, hidden states, training, export and evaluation.

Each step runs the project's own command (``hsgen generate``, ``spectrain train``, ``spectrain
export``, ``spectrain eval``) on the files of the one before, as a user would. Used by
``bench_quality.py`` and ``bench_storage.py``; not a benchmark itself.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

from quality_inputs import reproducible
from quality_sizes import BenchSize
from quality_target import is_held_out, stdlib_files

log = logging.getLogger("bench_quality")

# --------------------------------------------------------------------------- prompts


def make_prompts(target: Path, size: BenchSize, work: Path, device: str, seed: int = 0) -> tuple[Path, Path]:
    """Write ``train.jsonl`` (prompt + the target's greedy continuation, loss mask on the
    continuation) and ``eval.jsonl`` (held-out prompts) under ``work``: windows drawn by ``seed``,
    continuations computed :func:`quality_inputs.reproducible` (the same bits on every run)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    train_path, eval_path = work / "train.jsonl", work / "eval.jsonl"
    if train_path.is_file() and eval_path.is_file():
        return train_path, eval_path
    tokenizer = AutoTokenizer.from_pretrained(target)
    files = stdlib_files(size.target.corpus_share)
    rng = random.Random(seed)

    def windows(pool: list[tuple[str, str]], n: int, tag: str) -> list[tuple[str, list[int]]]:
        out = []
        batch = tokenizer([text for _, text in pool], add_special_tokens=False)[
            "input_ids"
        ]  # parallel in Rust
        encoded = [(rel, ids) for (rel, _), ids in zip(pool, batch, strict=True)]
        encoded = [(rel, ids) for rel, ids in encoded if len(ids) > size.prompt_tokens + 8]
        while len(out) < n:
            rel, ids = rng.choice(encoded)
            start = rng.randrange(0, len(ids) - size.prompt_tokens)
            out.append((f"{tag}-{len(out):05d}:{rel}:{start}", ids[start : start + size.prompt_tokens]))
        return out

    train_w = windows([f for f in files if not is_held_out(f[0])], size.num_train_prompts, "train")
    eval_w = windows([f for f in files if is_held_out(f[0])], size.num_eval_prompts, "eval")
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).to(device).eval()
    t0 = time.perf_counter()
    with reproducible(device):
        rows = _continue(model, tokenizer, train_w, size.continuation_tokens, device)
    log.info(
        "data: %d training prompts continued by the target in %.0fs", len(rows), time.perf_counter() - t0
    )
    work.mkdir(parents=True, exist_ok=True)
    with open(train_path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    with open(eval_path, "w") as f:
        f.writelines(json.dumps({"id": sid, "input_ids": ids}) + "\n" for sid, ids in eval_w)
    return train_path, eval_path


def _continue(model, tokenizer, windows: list[tuple[str, list[int]]], new_tokens: int, device: str,
              bs: int = 64) -> list[dict]:  # fmt: skip
    """Each window continued greedily by the target for ``new_tokens`` (a row with its loss mask)."""
    import torch

    rows = []
    for i in range(0, len(windows), bs):
        chunk = windows[i : i + bs]
        x = torch.tensor([ids for _, ids in chunk], device=device)
        with torch.no_grad():
            y = model.generate(
                input_ids=x,
                attention_mask=torch.ones_like(x),
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                pad_token_id=tokenizer.pad_token_id,
            )
        for (sid, ids), full in zip(chunk, y.tolist(), strict=True):
            cont = full[len(ids) :]
            rows.append({"id": sid, "input_ids": ids + cont, "loss_mask": [0] * len(ids) + [1] * len(cont)})
    return rows


# --------------------------------------------------------------------------- commands


def run(cmd: list[str], what: str, ok: tuple[int, ...] = (0,), in_process: bool = False) -> str:
    """Run a CLI step; stderr passes through; returns the last stdout line.

    ``in_process``: a ``spectrain`` step runs through the command's own entry point inside this
    process (the same code as the console script, without a new interpreter and torch import)."""
    here = in_process and cmd[:3] == spectrain_cmd()
    log.info("%s%s: %s", what, " (in this process)" if here else "", " ".join(cmd))
    t0 = time.perf_counter()
    if here:
        code, stdout = _spectrain_in_process(cmd[3:])
    else:
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
        code, stdout = proc.returncode, proc.stdout
    if code not in ok:
        raise SystemExit(f"{what} failed with exit status {code}: {' '.join(cmd)}")
    log.info("%s: done in %.0fs", what, time.perf_counter() - t0)
    lines = stdout.strip().splitlines()
    return lines[-1] if lines else ""


def _spectrain_in_process(args: list[str]) -> tuple[int, str]:
    """``spectrain ARGS`` run by its click group in this process: (exit status, stdout), with the
    exit status the console script would have (usage errors 2, ``sys.exit(n)`` n, a message 1)."""
    import click

    from spectrain.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        try:
            code = main.main(args, prog_name="spectrain", standalone_mode=False)
        except click.ClickException as e:
            e.show()
            code = e.exit_code
        except click.exceptions.Abort:
            code = 1
        except SystemExit as e:
            if isinstance(e.code, str):
                print(e.code, file=sys.stderr)
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    return (code if isinstance(code, int) else 0), out.getvalue()


def torch_threads() -> int:
    """The thread count set by ``--threads`` (inherited by the subprocesses through OMP_NUM_THREADS)."""
    import torch

    return torch.get_num_threads()


def hsgen_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "hsgen.cli", *args]


def spectrain_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "spectrain.cli", *args]


def _stored_samples(store: Path) -> int:
    """Samples a store already holds (0 when it does not exist yet)."""
    from hsgen.store import HiddenStateStore, StoreError

    try:
        return len(HiddenStateStore.open(store).sample_ids())
    except (StoreError, FileNotFoundError):
        return 0


def generate_hidden_states(
    target: Path, train_jsonl: Path, layer_ids: list[int], work: Path, device: str, in_process: bool = False
) -> Path:
    """Start the reference server on the target (in a thread of this process with ``in_process``)
    and fill a store with ``hsgen generate``."""
    from hsgen.serve.testing import running_server

    store = work / "store"
    shared = work / "server-files"
    wanted = sum(1 for line in train_jsonl.open() if line.strip())
    if _stored_samples(store) >= wanted:  # a kept store (ablations run side by side share it)
        log.info("store: %s already holds the %d samples", store, wanted)
        return store
    threads = torch_threads()
    with running_server(
        target,
        layer_ids,
        shared,
        mode="thread" if in_process else "process",
        dtype="float32",
        torch_threads=threads,
    ) as url:
        summary = run(
            hsgen_cmd(
                "generate", str(train_jsonl), "--store", str(store), "--endpoint", url, "--shared-dir", str(shared),
                "--layer-ids", ",".join(map(str, layer_ids)), "--verifier", "bench/stdlib-target",
                "--log-level", "warning", "--no-progress",
            ),
            "hsgen generate",
        )  # fmt: skip
    log.info("store: %s", summary)
    stored = _stored_samples(store)
    if stored < wanted:  # nothing to train on is not a measurement
        raise SystemExit(f"hsgen generate stored {stored} of {wanted} samples in {store}: {summary}")
    return store


def train_draft(algorithm: str, size: BenchSize, target: Path, store: Path, aux: list[int], work: Path,
                device: str, extra: list[str] | None = None, tag: str = "") -> tuple[Path, dict]:  # fmt: skip
    """``spectrain train`` (with ``extra`` flags) then ``spectrain export``; returns the exported
    directory and the train summary with the run's compute (``train_flops``, ``step_time_s``)."""
    suffix = f"{algorithm}-{tag}" if tag else algorithm
    save = work / f"train-{suffix}"
    if save.exists():
        shutil.rmtree(save)
    args = [
        "train", "--store", str(store), "--verifier", str(target), "--verifier-name", "bench/stdlib-target",
        "--speculator-type", algorithm, "--save-path", str(save), "--epochs", str(size.draft_epochs),
        "--lr", str(size.eagle3_lr if algorithm == "eagle3" else size.dflash_lr), "--total-seq-len", str(size.draft_seq_len), "--save-every", "0",
        "--val-fraction", "0.02", "--target-layer-ids", " ".join(map(str, aux)), "--seed", "0",
        "--device", "cuda" if device.startswith("cuda") else "cpu", "--num-workers", "0", "--resume", "none",
    ]  # fmt: skip
    if algorithm in ("dflash", "dspark"):  # DSpark anchor-first: one slot fewer for the same K proposals
        block = size.dflash_block_size - (algorithm == "dspark")
        args += ["--num-layers", str(size.dflash_layers), "--block-size", str(block),
                 "--max-anchors", str(size.dflash_max_anchors)]  # fmt: skip
    else:
        args += ["--ttt-steps", str(size.eagle3_ttt_steps)]
    args += extra or []
    t0 = time.perf_counter()
    summary = json.loads(
        run(spectrain_cmd(*args), f"spectrain train ({suffix})", in_process=size.in_process) or "{}"
    )
    if not summary.get("step"):
        raise SystemExit(f"spectrain train ({suffix}) trained no step: {summary}")
    summary["train_seconds"] = round(time.perf_counter() - t0, 1)
    summary.update(training_compute(save / "metrics.jsonl", int(summary.get("step") or 0)))
    checkpoint = save / (save / "latest").read_text().strip()
    out = work / f"draft-{suffix}"
    # spectrain eval measures it: an ablation vLLM could not serve (rank 0, a gated head) is written too
    export = ["export", str(checkpoint), str(out), "--verifier-name", "bench/stdlib-target", "--allow-unservable"]  # fmt: skip
    run(spectrain_cmd(*export), "spectrain export", in_process=size.in_process)
    return out, summary


def training_compute(metrics: Path, steps: int) -> dict:
    """Matmul FLOPs of a ``steps``-step run (the trainer's own count, per logged step) and its mean
    step time, from the run's metrics log."""
    flops = seconds = 0.0
    logged = last = 0
    for line in metrics.read_text().splitlines():
        rec = json.loads(line)
        if rec.get("split") != "train":
            continue
        n = rec["step"] - last
        last = rec["step"]
        flops += rec["flops_per_s"] * rec["step_time_s"] * n
        seconds += rec["step_time_s"] * n
        logged += n
    logged = max(logged, 1)
    return {"train_flops": flops / logged * steps, "step_time_s": round(seconds / logged, 4)}


def export_untrained(aux: list[int], size: BenchSize, target: Path, out: Path) -> Path:
    """The baseline: the benchmark's DFlash architecture at its initialization, exported the same way."""
    import torch

    from spectrain.export.write import export_draft
    from spectrain.models import build_draft, get_config_class
    from spectrain.models.verifier import VerifierHeads

    cfg = get_config_class("dflash")(aux_layer_ids=tuple(aux), num_layers=size.dflash_layers,
                                     block_size=size.dflash_block_size, max_anchors=size.dflash_max_anchors)  # fmt: skip
    torch.manual_seed(0)
    model = build_draft(cfg, VerifierHeads.load(target))
    return export_draft(model, out, verifier_name="bench/stdlib-target")


def evaluate_draft(draft: Path, target: Path, eval_jsonl: Path, size: BenchSize, device: str) -> dict:
    """``spectrain eval``'s report on the held-out prompts (exits when it decoded nothing)."""
    line = run(
        spectrain_cmd(
            "eval", "--draft", str(draft), "--verifier", str(target), "--prompts", str(eval_jsonl),
            "--max-new-tokens", str(size.eval_new_tokens), "--device", device, "--json", "--no-progress",
            "-k", str(size.num_speculative_tokens), "--torch-threads", str(torch_threads()),
        ),
        f"spectrain eval ({draft.name})",
        ok=(0, 1),  # 1: an output differed from greedy decoding; reported as exact_match false
        in_process=size.in_process,
    )  # fmt: skip
    result = json.loads(line or "{}")
    if not result.get("steps") or not result.get("new_tokens"):
        raise SystemExit(f"spectrain eval ({draft.name}) decoded nothing: {line!r}")
    return result
