"""The quality benchmark's target: a small Qwen3-style LM trained on the standard library's sources.

``ensure_target(cache, spec, device)`` returns the trained target for a :class:`TargetSpec`,
building it on first use: a BPE tokenizer trained on the Python standard library's ``.py`` files
(5% of them held out, never trained on), then a plain next-token loop on the same sources. Built
targets are cached under the cache directory, keyed by ``TargetSpec.fingerprint()``. Used by
``bench_quality.py`` and ``bench_storage.py``; not a benchmark itself.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import math
import os
import shutil
import sys
import sysconfig
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from quality_inputs import build_key_digest, environment, reproducible, sha256_file

log = logging.getLogger("bench_quality")

BENCH_VERSION = 2
"""Bump when a change must invalidate cached targets (2: built reproducibly, weights hashed)."""


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
    corpus_share: int = 1
    """Build on one standard-library file in ``corpus_share`` (chosen by a hash of its path, held-out
    files among them kept out as always), tokenizer, training and prompts alike; 1: every file."""

    def fingerprint(self) -> str:
        fields = dataclasses.asdict(self)
        if fields["corpus_share"] == 1:  # added later: absent at 1, so targets cached before keep their key
            del fields["corpus_share"]
        payload = {"v": BENCH_VERSION, "py": sys.version_info[:2], **fields}
        return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:12]


# --------------------------------------------------------------------------- corpus


def stdlib_files(share: int = 1) -> list[tuple[str, str]]:
    """``(relative path, text)`` of the standard library's ``.py`` files, tests excluded, sorted;
    with ``share`` N > 1, one file in N (by a hash of the path, independent of :func:`is_held_out`)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "test", "tests", "idlelib", "lib2to3", "__pycache__"}
    out = []
    for p in sorted(root.rglob("*.py")):
        rel = p.relative_to(root)
        if any(part in skip or part.startswith("test") for part in rel.parts):
            continue
        if share > 1 and int(hashlib.sha1(f"share:{rel}".encode()).hexdigest(), 16) % share:
            continue
        try:
            out.append((str(rel), p.read_text(encoding="utf-8")))
        except (UnicodeDecodeError, OSError):
            continue
    if not out:
        raise SystemExit(f"no Python sources found under {root}")
    return out


def corpus_sha256(files: list[tuple[str, str]]) -> str:
    """sha256 of the corpus a target is built on (each file's path and text, in order)."""
    h = hashlib.sha256()
    for rel, text in files:
        h.update(f"{rel}\0{len(text)}\0".encode())
        h.update(text.encode())
    return h.hexdigest()


def is_held_out(rel: str) -> bool:
    """5% of the files, chosen by a hash of the path: never trained on, by the target or the drafts."""
    return int(hashlib.sha1(rel.encode()).hexdigest(), 16) % 20 == 0


# --------------------------------------------------------------------------- the target


class TargetError(Exception):
    """A target directory that cannot be used as it is (one line naming the file and what is wrong)."""


def target_facts(target: Path) -> dict:
    """The record of a built target (``bench_target.json``) after checking that its weights are the
    ones recorded: raises :class:`TargetError` naming the file when the record is missing, has no
    weights hash (built before hashes were recorded) or the weights' sha256 differs from it."""
    record = target / "bench_target.json"
    weights = target / "model.safetensors"
    if not record.is_file():
        raise TargetError(f"{record}: missing (not a target built by bench_quality.py)")
    facts = json.loads(record.read_text())
    want = facts.get("weights_sha256")
    if not want:
        raise TargetError(f"{record}: no weights_sha256 (built before targets recorded their hashes)")
    if not weights.is_file():
        raise TargetError(f"{weights}: missing")
    have = sha256_file(weights)
    if have != want:
        raise TargetError(
            f"{weights}: sha256 {have[:16]} is not the {want[:16]} its bench_target.json records"
        )
    return facts


def ensure_target(cache: Path, spec: TargetSpec, device: str) -> Path:
    """The trained target directory for ``spec`` (trained and cached on first use).

    The directory is ``target-<spec fingerprint>-<build key>``: the key names the library versions
    and kernel set (:func:`quality_inputs.build_key`), so a target another environment built is
    another directory, never taken for this one's. A cached target is used only when its weights
    hash to what its record says; otherwise the mismatch is logged (one line: which file, which
    hashes), the directory is moved aside to ``<name>.mismatch-<time>`` (kept, not deleted) and the
    target is built anew."""
    target = cache / f"target-{spec.fingerprint()}-{build_key_digest(environment(device))}"
    if target.exists():
        try:
            target_facts(target)
            log.info("target: cached %s (weights sha256 checked)", target)
            return target
        except TargetError as e:
            aside = target.with_name(f"{target.name}.mismatch-{time.strftime('%Y%m%d-%H%M%S')}")
            log.error("target: %s; moved to %s and building it anew", e, aside)
            os.rename(target, aside)
    cache.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".building-", dir=cache))
    try:
        model_dir = staging / "model"
        with reproducible(device) as settings:
            _build_and_train_target(model_dir, spec, device, settings)
        with contextlib.suppress(OSError):
            os.rename(model_dir, target)
        target_facts(target)
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


def _build_and_train_target(model_dir: Path, spec: TargetSpec, device: str, settings: dict) -> None:
    import torch
    from tqdm import tqdm
    from transformers import AutoTokenizer, Qwen3ForCausalLM

    from hsgen.hf.tiny import TinyModelSpec, build_model_dir

    files = stdlib_files(spec.corpus_share)
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
        "corpus_sha256": corpus_sha256(files),
        "train_loss_ema": ema,
        "held_out_loss": held_loss,
        "train_seconds": train_s,
        "device": device,
        "weights_sha256": sha256_file(model_dir / "model.safetensors"),
        "tokenizer_sha256": sha256_file(model_dir / "tokenizer.json"),
        "built_with": {**environment(device), **settings},
    }
    (model_dir / "bench_target.json").write_text(json.dumps(facts, indent=2) + "\n")
    log.info("target: trained in %.0fs, train loss %.3f, held-out loss %.3f", train_s, ema, held_loss)
