#!/usr/bin/env python
"""End-to-end quality benchmark: measured acceptance length of trained DFlash and Eagle3 drafts.

No model can be downloaded, so the script builds a small but real target first:

1. **Target.** A Qwen3-style causal LM (the architecture of ``hsgen serve --model tiny``, larger)
   with a BPE tokenizer trained on the Python standard library's own sources, its weights
   trained with a plain next-token loop on the same sources. Cached under
   ``$HSGEN_CACHE/bench-quality`` (keyed by size, settings and Python version).
2. **Data.** Training prompts are windows of standard-library files (5% of the files are held
   out for evaluation); the target continues each greedily, as the DFlash and EAGLE papers
   regenerate responses with the target. The reference server (``hsgen serve``) and
   ``hsgen generate`` land the hidden states in a store, exactly as with vLLM.
3. **Drafts.** ``spectrain train`` trains a DFlash and an Eagle3 draft on the same data (same
   samples and epochs; each at its own swept learning rate), ``spectrain export`` writes vLLM
   directories, and an untrained DFlash draft is exported as the baseline.
4. **Eval.** ``spectrain eval``'s speculative decoding (greedy verification, outputs checked
   against the target's own greedy decoding) on held-out prompts.

The last stdout line is JSON with ``tau_dflash``, ``tau_eagle3``, ``tau_baseline``,
``exact_match``. Ablations: ``--only dflash --train-args '--optimizer muon' --tag muon --work DIR``
trains and evaluates one draft with extra ``spectrain train`` flags against the store kept in
``DIR`` (the last line then holds that draft's ``tau``, per-position acceptance, training FLOPs
and CPU step time). Sizes: ``--quick`` (~70 s on 2 CPU cores once its target is cached, ~100 s before), the default (~30 minutes on
CPU) and ``--size gpu`` (chosen automatically when CUDA is available).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import json
import logging
import math
import os
import random
import shlex
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("bench_quality")

BENCH_VERSION = 1
"""Bump when a change must invalidate cached targets."""


# --------------------------------------------------------------------------- settings


@dataclass(frozen=True)
class TargetSpec:
    """The target LM: shape, tokenizer and its training run."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    tokenizer_vocab_size: int
    train_steps: int
    """Optimizer steps of next-token training."""
    batch_size: int
    seq_len: int
    lr: float
    seed: int = 0

    def fingerprint(self) -> str:
        payload = {"v": BENCH_VERSION, "py": sys.version_info[:2], **dataclasses.asdict(self)}
        return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:12]


@dataclass(frozen=True)
class BenchSize:
    """One benchmark size: target, data and the drafts' common budget."""

    target: TargetSpec
    num_train_prompts: int
    prompt_tokens: int
    """Tokens of standard-library text before the target's continuation."""
    continuation_tokens: int
    """Greedy tokens of the target after each training prompt (the trained positions)."""
    num_eval_prompts: int
    eval_new_tokens: int
    draft_epochs: int
    """Passes over the training prompts, the same for both drafts (the equal budget)."""
    dflash_lr: float
    """Peak learning rate of each draft, swept on this size with its default optimizer."""
    eagle3_lr: float
    draft_seq_len: int
    """Tokens per packed training sequence (``--total-seq-len``)."""
    dflash_layers: int
    dflash_max_anchors: int
    """DFlash anchors drawn per packed sequence (the paper: 512 per 3072-token sequence)."""
    dflash_block_size: int
    """DFlash block; both drafts are evaluated with ``K = dflash_block_size - 1`` tokens per step."""
    eagle3_ttt_steps: int
    """Eagle3 training-time-test steps (its chain still drafts K tokens at evaluation, as in vLLM)."""

    @property
    def num_speculative_tokens(self) -> int:
        return self.dflash_block_size - 1


SIZES: dict[str, BenchSize] = {
    "quick": BenchSize(
        target=TargetSpec(128, 4, 4, 2, 32, 384, 1024, 120, 16, 128, 6e-3),
        num_train_prompts=128,
        prompt_tokens=32,
        continuation_tokens=64,
        num_eval_prompts=8,
        eval_new_tokens=40,
        draft_epochs=2,
        dflash_lr=3e-3,
        eagle3_lr=3e-3,
        draft_seq_len=1024,
        dflash_layers=2,
        dflash_max_anchors=256,
        dflash_block_size=8,
        eagle3_ttt_steps=3,
    ),
    "default": BenchSize(
        target=TargetSpec(192, 6, 6, 2, 32, 512, 2048, 500, 8, 256, 4e-3),
        num_train_prompts=640,
        prompt_tokens=32,
        continuation_tokens=96,
        num_eval_prompts=24,
        eval_new_tokens=64,
        draft_epochs=3,
        dflash_lr=3e-3,
        eagle3_lr=2e-3,
        draft_seq_len=1024,
        dflash_layers=2,
        dflash_max_anchors=256,
        dflash_block_size=8,
        eagle3_ttt_steps=3,
    ),
    "gpu": BenchSize(
        target=TargetSpec(512, 8, 8, 4, 64, 1536, 4096, 6000, 32, 512, 1.5e-3),
        num_train_prompts=8192,
        prompt_tokens=64,
        continuation_tokens=192,
        num_eval_prompts=64,
        eval_new_tokens=128,
        draft_epochs=6,
        dflash_lr=6e-4,
        eagle3_lr=6e-4,
        draft_seq_len=8192,
        dflash_layers=5,
        dflash_max_anchors=2048,
        dflash_block_size=16,
        eagle3_ttt_steps=7,
    ),
}


SPECULATORS_OPTIMIZER = (
    "--optimizer muon --lr 1e-3 --weight-decay 0.01 --betas 0.9,0.999 --schedule linear --warmup-ratio 0.01"
)
SPECULATORS_RECIPE = {
    "dflash": "--target-mode hard --loss-weighting dpace --loss-norm count --anchor-rule packed "
    "--block-attention causal --sliding-window 2048 " + SPECULATORS_OPTIMIZER,
    "eagle3": "--target-mode soft --loss-norm count --loss-mask-on source --freeze-lm-head --norm-before-fc "
    "--norm-output --ttt-step-loss-decay 1.0 --sliding-window 2048 " + SPECULATORS_OPTIMIZER,
}
"""speculators 0.9.0's defaults as our options (tests/spectrain/test_differential_*.py prove them equal):
``--recipe speculators`` trains with these, standing in for its trainer in a side-by-side run."""


# --------------------------------------------------------------------------- corpus


def stdlib_files() -> list[tuple[str, str]]:
    """``(relative path, text)`` of the standard library's ``.py`` files, tests excluded, sorted."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "test", "tests", "idlelib", "lib2to3", "__pycache__"}
    out = []
    for p in sorted(root.rglob("*.py")):
        rel = p.relative_to(root)
        if any(part in skip or part.startswith("test") for part in rel.parts):
            continue
        try:
            out.append((str(rel), p.read_text(encoding="utf-8")))
        except (UnicodeDecodeError, OSError):
            continue
    if not out:
        raise SystemExit(f"no Python sources found under {root}")
    return out


def is_held_out(rel: str) -> bool:
    """5% of the files, chosen by a hash of the path: never trained on, by the target or the drafts."""
    return int(hashlib.sha1(rel.encode()).hexdigest(), 16) % 20 == 0


# --------------------------------------------------------------------------- the target


def ensure_target(cache: Path, spec: TargetSpec, device: str) -> Path:
    """The trained target directory for ``spec`` (trained and cached on first use)."""
    target = cache / f"target-{spec.fingerprint()}"
    if (target / "bench_target.json").is_file():
        log.info("target: cached %s", target)
        return target
    cache.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".building-", dir=cache))
    try:
        model_dir = staging / "model"
        _build_and_train_target(model_dir, spec, device)
        with contextlib.suppress(OSError):
            os.rename(model_dir, target)
        if not (target / "bench_target.json").is_file():
            raise RuntimeError(f"could not move the trained target into {target}")
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _token_stream(tokenizer, files: list[tuple[str, str]]) -> list[int]:
    eot = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    ids: list[int] = []
    for _, text in files:
        ids.extend(tokenizer.encode(text, add_special_tokens=False))
        ids.append(eot)
    return ids


def _build_and_train_target(model_dir: Path, spec: TargetSpec, device: str) -> None:
    import torch
    from tqdm import tqdm
    from transformers import AutoTokenizer, Qwen3ForCausalLM

    from hsgen.tiny import TinyModelSpec, build_model_dir

    files = stdlib_files()
    train_files = [f for f in files if not is_held_out(f[0])]
    held_files = [f for f in files if is_held_out(f[0])]
    t0 = time.perf_counter()
    tiny = TinyModelSpec(
        hidden_size=spec.hidden_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        head_dim=spec.head_dim,
        intermediate_size=spec.intermediate_size,
        tokenizer_vocab_size=spec.tokenizer_vocab_size,
        seed=spec.seed,
        corpus="python-stdlib",
    )
    build_model_dir(model_dir, tiny, texts=(text for _, text in train_files))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    train_ids = torch.tensor(_token_stream(tokenizer, train_files), dtype=torch.long)
    held_ids = torch.tensor(_token_stream(tokenizer, held_files), dtype=torch.long)
    log.info(
        "target: tokenizer trained (%d tokens) in %.0fs; corpus %d train / %d held-out tokens",
        len(tokenizer),
        time.perf_counter() - t0,
        len(train_ids),
        len(held_ids),
    )
    model = Qwen3ForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device)
    model.train()
    gen = torch.Generator().manual_seed(spec.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=spec.lr, weight_decay=0.1, betas=(0.9, 0.95))
    warmup = max(1, spec.train_steps // 20)

    def lr_at(step: int) -> float:
        if step < warmup:
            return spec.lr * (step + 1) / warmup
        frac = (step - warmup) / max(1, spec.train_steps - warmup)
        return spec.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))

    def batch(ids: torch.Tensor, n: int, g: torch.Generator) -> torch.Tensor:
        starts = torch.randint(0, len(ids) - spec.seq_len - 1, (n,), generator=g)
        return torch.stack([ids[s : s + spec.seq_len] for s in starts.tolist()]).to(device)

    t0 = time.perf_counter()
    bar = tqdm(range(spec.train_steps), desc="target", unit="step", file=sys.stderr,
               mininterval=0.5 if sys.stderr.isatty() else 15)  # fmt: skip
    ema = None
    for step in bar:
        for group in opt.param_groups:
            group["lr"] = lr_at(step)
        x = batch(train_ids, spec.batch_size, gen)
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        ema = loss.item() if ema is None else 0.95 * ema + 0.05 * loss.item()
        bar.set_postfix(loss=f"{ema:.3f}", refresh=False)
    train_s = time.perf_counter() - t0
    model.eval()
    with torch.no_grad():
        g = torch.Generator().manual_seed(1234)
        held_loss = (
            sum(model(input_ids=(x := batch(held_ids, 8, g)), labels=x).loss.item() for _ in range(8)) / 8
        )
    model.to("cpu").save_pretrained(model_dir, safe_serialization=True)
    facts = {
        "spec": dataclasses.asdict(spec),
        "python": sys.version.split()[0],
        "train_tokens_seen": spec.train_steps * spec.batch_size * spec.seq_len,
        "corpus_train_tokens": len(train_ids),
        "train_loss_ema": ema,
        "held_out_loss": held_loss,
        "train_seconds": train_s,
        "device": device,
    }
    (model_dir / "bench_target.json").write_text(json.dumps(facts, indent=2) + "\n")
    log.info("target: trained in %.0fs, train loss %.3f, held-out loss %.3f", train_s, ema, held_loss)


# --------------------------------------------------------------------------- prompts


def make_prompts(target: Path, size: BenchSize, work: Path, device: str, seed: int = 0) -> tuple[Path, Path]:
    """Write ``train.jsonl`` (prompt + the target's greedy continuation, loss mask on the
    continuation) and ``eval.jsonl`` (held-out prompts) under ``work``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    train_path, eval_path = work / "train.jsonl", work / "eval.jsonl"
    if train_path.is_file() and eval_path.is_file():
        return train_path, eval_path
    tokenizer = AutoTokenizer.from_pretrained(target)
    files = stdlib_files()
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
    rows = []
    t0 = time.perf_counter()
    bs = 64
    for i in range(0, len(train_w), bs):
        chunk = train_w[i : i + bs]
        x = torch.tensor([ids for _, ids in chunk], device=device)
        with torch.no_grad():
            y = model.generate(
                input_ids=x,
                attention_mask=torch.ones_like(x),
                max_new_tokens=size.continuation_tokens,
                min_new_tokens=size.continuation_tokens,
                do_sample=False,
                pad_token_id=tokenizer.pad_token_id,
            )
        for (sid, ids), full in zip(chunk, y.tolist(), strict=True):
            cont = full[len(ids) :]
            rows.append({"id": sid, "input_ids": ids + cont, "loss_mask": [0] * len(ids) + [1] * len(cont)})
    log.info(
        "data: %d training prompts continued by the target in %.0fs", len(rows), time.perf_counter() - t0
    )
    work.mkdir(parents=True, exist_ok=True)
    with open(train_path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    with open(eval_path, "w") as f:
        f.writelines(json.dumps({"id": sid, "input_ids": ids}) + "\n" for sid, ids in eval_w)
    return train_path, eval_path


# --------------------------------------------------------------------------- layers


def draft_layers(num_hidden_layers: int) -> tuple[list[int], list[int]]:
    """``(dflash aux ids, eagle3 aux ids)``: the project defaults, spread out when they collapse.

    The defaults (DFlash: 5 layers from 1 to L-3; Eagle3: 2, L//2, L-3) assume a deep verifier;
    on a 4-6 layer target they collapse to one or two distinct layers.
    """
    from hsgen import protocol

    L = num_hidden_layers
    dflash = protocol.default_dflash_layer_ids(L, 5)[:-1]
    if len(dflash) < 3:
        dflash = sorted({round(1 + i * (L - 2) / 4) for i in range(5)})
    eagle = protocol.default_eagle3_layer_ids(L)[:-1]
    if len(eagle) != 3:
        eagle = [1, L // 2, L - 1]
    return dflash, eagle


# --------------------------------------------------------------------------- subprocesses


def run(cmd: list[str], what: str, ok: tuple[int, ...] = (0,)) -> str:
    """Run a CLI step; stderr passes through; returns the last stdout line."""
    log.info("%s: %s", what, " ".join(cmd))
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
    if proc.returncode not in ok:
        raise SystemExit(f"{what} failed with exit status {proc.returncode}: {' '.join(cmd)}")
    log.info("%s: done in %.0fs", what, time.perf_counter() - t0)
    lines = proc.stdout.strip().splitlines()
    return lines[-1] if lines else ""


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
    target: Path, train_jsonl: Path, layer_ids: list[int], work: Path, device: str
) -> Path:
    """Start the reference server on the target and fill a store with ``hsgen generate``."""
    from hsgen.serve.testing import running_server

    store = work / "store"
    shared = work / "server-files"
    wanted = sum(1 for line in train_jsonl.open() if line.strip())
    if _stored_samples(store) >= wanted:  # a kept store (ablations run side by side share it)
        log.info("store: %s already holds the %d samples", store, wanted)
        return store
    threads = torch_threads()
    with running_server(
        target, layer_ids, shared, mode="process", dtype="float32", torch_threads=threads
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
        "--lr", str(size.dflash_lr if algorithm == "dflash" else size.eagle3_lr), "--total-seq-len", str(size.draft_seq_len), "--save-every", "0",
        "--val-fraction", "0.02", "--target-layer-ids", " ".join(map(str, aux)), "--seed", "0",
        "--device", "cuda" if device.startswith("cuda") else "cpu", "--num-workers", "0", "--resume", "none",
    ]  # fmt: skip
    if algorithm == "dflash":
        args += ["--num-layers", str(size.dflash_layers), "--block-size", str(size.dflash_block_size),
                 "--max-anchors", str(size.dflash_max_anchors)]  # fmt: skip
    else:
        args += ["--ttt-steps", str(size.eagle3_ttt_steps)]
    args += extra or []
    t0 = time.perf_counter()
    summary = json.loads(run(spectrain_cmd(*args), f"spectrain train ({suffix})") or "{}")
    summary["train_seconds"] = round(time.perf_counter() - t0, 1)
    summary.update(training_compute(save / "metrics.jsonl", int(summary.get("step") or 0)))
    checkpoint = save / (save / "latest").read_text().strip()
    out = work / f"draft-{suffix}"
    run(
        spectrain_cmd("export", str(checkpoint), str(out), "--verifier-name", "bench/stdlib-target"),
        "spectrain export",
    )
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

    from spectrain.export import export_draft
    from spectrain.models import build_draft, get_config_class
    from spectrain.verifier import VerifierHeads

    cfg = get_config_class("dflash")(aux_layer_ids=tuple(aux), num_layers=size.dflash_layers,
                                     block_size=size.dflash_block_size, max_anchors=size.dflash_max_anchors)  # fmt: skip
    torch.manual_seed(0)
    model = build_draft(cfg, VerifierHeads.load(target))
    return export_draft(model, out, verifier_name="bench/stdlib-target")


def evaluate_draft(draft: Path, target: Path, eval_jsonl: Path, size: BenchSize, device: str) -> dict:
    line = run(
        spectrain_cmd(
            "eval", "--draft", str(draft), "--verifier", str(target), "--prompts", str(eval_jsonl),
            "--max-new-tokens", str(size.eval_new_tokens), "--device", device, "--json", "--no-progress",
            "-k", str(size.num_speculative_tokens), "--torch-threads", str(torch_threads()),
        ),
        f"spectrain eval ({draft.name})",
        ok=(0, 1),  # 1: an output differed from greedy decoding; reported as exact_match false
    )  # fmt: skip
    return json.loads(line)


# --------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--quick", action="store_true", help="Smallest size: ~70 s on 2 CPU cores (~100 s the first time)."
    )
    parser.add_argument(
        "--size", choices=sorted(SIZES), default=None, help="Size (default: gpu with CUDA, else default)."
    )
    parser.add_argument("--device", default=None, help="Torch device (default: cuda if available, else cpu).")
    parser.add_argument(
        "--cache",
        type=Path,
        default=None,
        help="Where trained targets are kept (default: $HSGEN_CACHE/bench-quality).",
    )
    parser.add_argument(
        "--work",
        type=Path,
        default=None,
        help="Working directory (default: a temporary one, removed at the end).",
    )
    parser.add_argument(
        "--keep", action="store_true", help="Keep the working directory (store, checkpoints, drafts)."
    )
    parser.add_argument(
        "--only",
        choices=["dflash", "eagle3", "baseline"],
        default=None,
        help="Train and evaluate this draft only (ablations; the last line then describes it alone).",
    )
    parser.add_argument(
        "--train-args",
        default="",
        help="Extra `spectrain train` flags for the trained draft(s), e.g. '--optimizer muon --lr 1e-3'.",
    )
    parser.add_argument(
        "--recipe",
        choices=["ours", "speculators"],
        default="ours",
        help="Train with our defaults, or with speculators 0.9.0's recipe expressed as our options.",
    )
    parser.add_argument(
        "--tag", default="", help="Suffix of this run's train/draft directories under --work."
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="Torch threads of every step (1: fastest on a shared or busy machine; the core count on an idle one).",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s: %(message)s")

    import torch

    from hsgen.tiny import default_cache_dir

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    torch.set_num_threads(max(1, args.threads))
    os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = str(max(1, args.threads))
    size_name = "quick" if args.quick else (args.size or ("gpu" if device.startswith("cuda") else "default"))
    size = SIZES[size_name]
    cache = args.cache or default_cache_dir() / "bench-quality"
    work = args.work or Path(tempfile.mkdtemp(prefix=f"bench-quality-{size_name}-"))
    work.mkdir(parents=True, exist_ok=True)
    log.info("size %s on %s; working directory %s", size_name, device, work)
    t_start = time.perf_counter()
    timings: dict[str, float] = {}
    try:
        t0 = time.perf_counter()
        target = ensure_target(cache, size.target, device)
        timings["target"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        train_jsonl, eval_jsonl = make_prompts(target, size, work, device)
        timings["prompts"] = time.perf_counter() - t0
        L = size.target.num_hidden_layers
        dflash_aux, eagle_aux = draft_layers(L)
        store_layers = sorted({*dflash_aux, *eagle_aux, L})
        t0 = time.perf_counter()
        store = generate_hidden_states(target, train_jsonl, store_layers, work, device)
        timings["hidden_states"] = time.perf_counter() - t0
        results: dict[str, dict] = {}
        train_summaries = {}
        drafts = {}
        trained = [a for a in ("dflash", "eagle3") if args.only in (None, a)]
        tag = args.tag or ("speculators" if args.recipe == "speculators" else "")
        for algorithm in trained:
            aux = dflash_aux if algorithm == "dflash" else eagle_aux
            recipe = SPECULATORS_RECIPE[algorithm] if args.recipe == "speculators" else ""
            extra = shlex.split(recipe) + shlex.split(args.train_args)
            t0 = time.perf_counter()
            drafts[algorithm], train_summaries[algorithm] = train_draft(
                algorithm, size, target, store, aux, work, device, extra, tag
            )
            timings[f"train_{algorithm}"] = time.perf_counter() - t0
        if args.only in (None, "baseline"):
            drafts["baseline"] = export_untrained(dflash_aux, size, target, work / "draft-baseline")
        for name, path in drafts.items():
            t0 = time.perf_counter()
            results[name] = evaluate_draft(path, target, eval_jsonl, size, device)
            timings[f"eval_{name}"] = time.perf_counter() - t0
        timings["total"] = time.perf_counter() - t_start
        facts = json.loads((target / "bench_target.json").read_text())
        details = {
            "size": size_name,
            "device": device,
            "target": facts,
            "layers": {"dflash": dflash_aux, "eagle3": eagle_aux, "store": store_layers},
            "recipe": args.recipe,
            "train_args": args.train_args,
            "train": train_summaries,
            "eval": {
                name: {
                    k: r[k]
                    for k in (
                        "tau",
                        "num_speculative_tokens",
                        "acceptance_rate",
                        "accepted_histogram",
                        "steps",
                        "new_tokens",
                        "exact_match",
                    )
                }  # fmt: skip
                for name, r in results.items()
            },
            "timings_s": {k: round(v, 1) for k, v in timings.items()},
        }
        (work / f"results{'-' + tag if tag else ''}{'-' + args.only if args.only else ''}.json").write_text(
            json.dumps(details, indent=2) + "\n"
        )
        print(json.dumps(details, indent=2), file=sys.stderr)
        for name, r in results.items():
            rates = " ".join(f"{x:.2f}" for x in r["acceptance_rate"])
            print(
                f"{name:>9}: tau {r['tau']:.3f}  K={r['num_speculative_tokens']}  per-position {rates}",
                file=sys.stderr,
            )
        exact = all(r["exact_match"] for r in results.values())
        if args.only:
            r = results[args.only]
            t = train_summaries.get(args.only, {})
            final = {"draft": args.only, "tag": args.tag, "train_args": args.train_args, "tau": round(r["tau"], 4),
                     "acceptance_rate": [round(x, 3) for x in r["acceptance_rate"]],
                     "train_gflop": round(t.get("train_flops", 0.0) / 1e9, 1), "step_time_s": t.get("step_time_s"),
                     "train_seconds": t.get("train_seconds"), "exact_match": exact}  # fmt: skip
        else:
            final = {
                "tau_dflash": round(results["dflash"]["tau"], 4),
                "tau_eagle3": round(results["eagle3"]["tau"], 4),
                "tau_baseline": round(results["baseline"]["tau"], 4),
                "exact_match": exact,
            }
        print(json.dumps(final))
        return 0 if final["exact_match"] else 1
    finally:
        if args.work is None and not args.keep:
            shutil.rmtree(work, ignore_errors=True)
        elif args.keep or args.work:
            log.info("kept %s", work)


if __name__ == "__main__":
    sys.exit(main())
