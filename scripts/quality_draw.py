"""One data draw of the quality benchmark: prompts, hidden states, every draft trained and evaluated.

``run_draw(plan, seed, ...)`` draws the training windows and evaluation prompts with ``seed``,
has the target continue them, fills a store, trains our drafts (and, with ``plan.peer``, the
peer's: ``quality_peer.py``) on it, evaluates every draft with the same ``spectrain eval`` and
writes ``results*.json`` in the draw's directory. A draft is named ``dflash``, ``peer-dflash``, and
with a learning-rate sweep ``dflash@0.003``. The peer's trained drafts and their evaluations are
kept in the draw's directory and reused by a later run on it with the same command and prompts (an
ablation of ours trains the peer once). Used by ``bench_quality.py``; not a benchmark itself.
"""

from __future__ import annotations

import json
import logging
import shlex
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from quality_inputs import input_hashes, sha256_file
from quality_peer import COUNT_VERSION, cpu_seconds, train_peer
from quality_sizes import SPECULATORS_RECIPE, BenchSize, draft_layers
from quality_steps import evaluate_draft, export_untrained, generate_hidden_states, make_prompts, train_draft

log = logging.getLogger("bench_quality")

VAL_FRACTION = 0.02
"""Validation share of the samples for both trainers (``quality_steps.train_draft``'s)."""

EVAL_KEYS = ("tau", "num_speculative_tokens", "acceptance_rate", "accepted_histogram", "steps", "new_tokens",
             "exact_match", "per_prompt")  # fmt: skip


@dataclass(frozen=True)
class DrawPlan:
    """What a draw trains: our drafts (``baseline`` = the untrained DFlash), the peer's, the
    learning rates (``None``: each side's swept rate of the size) and our recipe's flags."""

    ours: tuple[str, ...]
    peer: tuple[str, ...] = ()
    lrs: tuple[float | None, ...] = (None,)
    recipe: str = "ours"
    train_args: str = ""
    tag: str = ""
    keep_peer_data: bool = False
    match_compute: bool = False
    """Cap each of our drafts that the peer also trains at the peer's counted training FLOPs
    (``--max-steps``, from a short probe of our per-step count): ours never trains on more compute."""


COMPUTE_MARGIN = 0.995
"""The share of the peer's FLOPs our capped run aims at: our per-step count varies a little with the
anchors' positions, and the probe sees only its first steps."""
PROBE_STEPS = 10


def draft_name(algorithm: str, side: str, lr: float | None) -> str:
    """``dflash``, ``peer-dflash``, ``dflash@0.003`` ..."""
    return ("peer-" if side == "peer" else "") + algorithm + (f"@{lr:g}" if lr is not None else "")


def size_lr(size: BenchSize, algorithm: str, side: str) -> float:
    """Each side's learning rate on ``size`` (ours swept with our trainer, the peer's with its own)."""
    if side == "peer":
        rates = {"dflash": size.peer_dflash_lr, "dspark": size.peer_dspark_lr, "eagle3": size.peer_eagle3_lr}
        return rates[algorithm]
    return size.eagle3_lr if algorithm == "eagle3" else size.dflash_lr


def run_draw(
    plan: DrawPlan, seed: int, work: Path, target: Path, facts: dict, size: BenchSize, device: str
) -> dict:
    """Everything of one draw: ``inputs`` (hashes), ``train`` and ``eval`` per draft name, ``timings_s``."""
    timings: dict[str, float] = {}
    t0 = time.perf_counter()
    train_jsonl, eval_jsonl = make_prompts(target, size, work, device, seed=seed)
    timings["prompts"] = time.perf_counter() - t0
    L = size.target.num_hidden_layers
    dflash_aux, eagle_aux = draft_layers(L)
    store_layers = sorted({*dflash_aux, *eagle_aux, L})
    t0 = time.perf_counter()
    store = generate_hidden_states(target, train_jsonl, store_layers, work, device, size.in_process)
    timings["hidden_states"] = time.perf_counter() - t0
    eval_sha, train_sha = sha256_file(eval_jsonl), sha256_file(train_jsonl)
    drafts: dict[str, Path] = {}
    train: dict[str, dict] = {}
    results: dict[str, dict] = {}
    tag = plan.tag or ("speculators" if plan.recipe == "speculators" else "")
    for algorithm in plan.peer:  # first: with match_compute, the peer's count caps ours
        aux = eagle_aux if algorithm == "eagle3" else dflash_aux
        for lr in plan.lrs:
            name = draft_name(algorithm, "peer", lr)
            rate = lr or size_lr(size, algorithm, "peer")
            t0 = time.perf_counter()
            reused = _reused_peer(work, algorithm, lr, rate, size, train_sha)
            if reused:
                drafts[name], train[name] = reused
            else:
                drafts[name], train[name] = train_peer(algorithm, size, target, store, aux, work, device, rate,
                                                       VAL_FRACTION, f"lr{lr:g}" if lr else "", plan.keep_peer_data)  # fmt: skip
                train[name].update(epochs=size.draft_epochs, train_jsonl_sha256=train_sha)
                (drafts[name].parent / "peer_summary.json").write_text(json.dumps(train[name], indent=1))
            timings[f"train_{name}"] = time.perf_counter() - t0
    for algorithm in (a for a in plan.ours if a != "baseline"):
        aux = eagle_aux if algorithm == "eagle3" else dflash_aux
        recipe = SPECULATORS_RECIPE[algorithm] if plan.recipe == "speculators" else ""
        for lr in plan.lrs:
            name = draft_name(algorithm, "ours", lr)
            extra = shlex.split(recipe) + shlex.split(plan.train_args) + (["--lr", repr(lr)] if lr else [])
            run_tag = "-".join(x for x in (tag, f"lr{lr:g}" if lr else "") if x)
            t0, c0 = time.perf_counter(), cpu_seconds()
            budget = train.get(draft_name(algorithm, "peer", lr), {}) if plan.match_compute else {}
            cap = _compute_cap(algorithm, size, target, store, aux, work, device, extra, run_tag, budget)
            capped = ["--max-steps", str(cap["max_steps"])] if cap else []
            drafts[name], train[name] = train_draft(
                algorithm, size, target, store, aux, work, device, extra + capped, run_tag
            )
            train[name].update(cap)
            train[name]["cpu_seconds"] = round(cpu_seconds() - c0, 1)
            train[name]["lr"] = lr or size_lr(size, algorithm, "ours")
            timings[f"train_{name}"] = time.perf_counter() - t0
    if "baseline" in plan.ours:
        drafts["baseline"] = export_untrained(dflash_aux, size, target, work / "draft-baseline")
    for name, path in drafts.items():
        t0 = time.perf_counter()
        cached = path.parent / f"eval-{eval_sha[:16]}.json" if name.startswith("peer-") else None
        if cached and cached.is_file():
            log.info("spectrain eval (%s): reusing %s", name, cached)
            results[name] = json.loads(cached.read_text())
        else:
            report = evaluate_draft(path, target, eval_jsonl, size, device)
            results[name] = {k: report[k] for k in EVAL_KEYS if k in report}
            if cached:
                cached.write_text(json.dumps(results[name]))
        timings[f"eval_{name}"] = time.perf_counter() - t0
    return {
        "seed": seed,
        "work": str(work),
        "inputs": input_hashes(facts, train_jsonl, eval_jsonl),
        "layers": {"dflash": dflash_aux, "dspark": dflash_aux, "eagle3": eagle_aux, "store": store_layers},
        "train": train,
        "eval": results,
        "timings_s": {k: round(v, 1) for k, v in timings.items()},
    }


def _compute_cap(algorithm: str, size: BenchSize, target: Path, store: Path, aux: list[int], work: Path,
                 device: str, extra: list[str], tag: str, peer: dict) -> dict:  # fmt: skip
    """With the peer's summary ``peer`` (its ``train_flops`` and ``step``): our per-step FLOPs from a
    :data:`PROBE_STEPS`-step run and ``max_steps``, the step where the peer's count would be passed
    (the caller always passes it as ``--max-steps``, since flags such as ``--epochs`` may give ours
    more steps than the peer's, and a cap beyond the data stops where the data does); ``{}`` without
    a peer."""
    if not peer.get("train_flops") or not peer.get("step"):
        return {}
    probe_tag = "-".join(x for x in (tag, "probe") if x)
    _, facts = train_draft(algorithm, size, target, store, aux, work, device,
                           [*extra, "--max-steps", str(PROBE_STEPS), "--log-every", str(PROBE_STEPS)], probe_tag)  # fmt: skip
    for d in (work / f"train-{algorithm}-{probe_tag}", work / f"draft-{algorithm}-{probe_tag}"):
        shutil.rmtree(d, ignore_errors=True)
    per_step = facts["train_flops"] / max(int(facts.get("step") or PROBE_STEPS), 1)
    fit = int(peer["train_flops"] * COMPUTE_MARGIN // per_step)
    log.info("compute (%s): %.1f GFLOP/step against the peer's %.1f GFLOP: at most %d steps",
             algorithm, per_step / 1e9, peer["train_flops"] / 1e9, fit)  # fmt: skip
    return {"compute_budget_flops": peer["train_flops"], "probe_flops_per_step": per_step, "max_steps": fit}


def _reused_peer(work: Path, algorithm: str, lr: float | None, rate: float, size: BenchSize,
                 train_sha: str) -> tuple[Path, dict] | None:  # fmt: skip
    """A peer draft an earlier run on this draw's directory trained on the same data with the same
    learning rate and epochs, or None."""
    suffix = f"{algorithm}-lr{lr:g}" if lr else algorithm
    save = work / f"peer-train-{suffix}"
    summary, final = save / "peer_summary.json", save / str(size.draft_epochs - 1)
    if not summary.is_file() or not (final / "model.safetensors").is_file():
        return None
    facts = json.loads(summary.read_text())
    if facts.get("count_version") != COUNT_VERSION:
        log.info("speculators train (%s): %s was counted another way; training it again", suffix, save)
        return None
    if (facts.get("lr"), facts.get("epochs"), facts.get("train_jsonl_sha256")) != (
        rate,
        size.draft_epochs,
        train_sha,
    ):
        return None
    log.info("speculators train (%s): reusing %s (same data, learning rate and epochs)", suffix, save)
    return final, facts
