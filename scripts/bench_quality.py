#!/usr/bin/env python
"""End-to-end quality benchmark: measured acceptance length of trained DFlash, DSpark and Eagle3 drafts.

No model can be downloaded, so the script builds a small but real target first:

1. **Target.** A Qwen3-style causal LM (the architecture of ``hsgen serve --model tiny``, larger)
   with a BPE tokenizer trained on the Python standard library's own sources, its weights
   trained with a plain next-token loop on the same sources. Cached under
   ``$HSGEN_CACHE/bench-quality`` (keyed by size, settings and Python version).
2. **Data.** Training prompts are windows of standard-library files (5% of the files are held
   out for evaluation); the target continues each greedily, as the DFlash and EAGLE papers
   regenerate responses with the target. The reference server (``hsgen serve``) and
   ``hsgen generate`` land the hidden states in a store, exactly as with vLLM.
3. **Drafts.** ``spectrain train`` trains a DFlash, a DSpark and an Eagle3 draft on the same data
   (same samples and epochs; each at its own swept learning rate; DSpark's anchor-first block is one
   slot shorter than DFlash's, so both propose K tokens), ``spectrain export`` writes vLLM
   directories, and an untrained DFlash draft is exported as the baseline.
4. **Eval.** ``spectrain eval``'s speculative decoding (greedy verification, outputs checked
   against the target's own greedy decoding) on held-out prompts.

The last stdout line is JSON with ``tau_dflash``, ``tau_dspark``, ``tau_eagle3``, ``tau_baseline``,
``exact_match`` and the input hashes (``target_weights_sha256``, ``train_jsonl_sha256``,
``eval_jsonl_sha256``). ``--peer`` trains speculators 0.9.0's own DFlash, DSpark and Eagle3 beside ours on
the same samples and hidden states (``quality_peer.py``) and adds ``peer_tau_*``, ``diff_*`` (ours
minus the peer, paired per prompt, mean over the draws) with ``diff_*_ci`` (95% bootstrap),
``min_diff_*`` (the worst draw's) and each side's training GFLOP. ``--seeds 0,1,2`` draws the
windows and evaluation prompts anew per seed (figures are then means over the draws, hashes lists
in seed order); ``--lrs`` sweeps the learning rate of both sides alike. Ablations: ``--only dflash --train-args '--optimizer muon' --tag muon --work DIR``
trains and evaluates one draft with extra ``spectrain train`` flags against the store kept in
``DIR`` (the last line then holds that draft's ``tau``, per-position acceptance, training FLOPs
and CPU step time). Sizes: ``--quick`` (a tiny target on an eighth of the corpus, 32 prompts, 4
evaluation prompts; every command runs in this process: under a minute on 2 CPU cores, target
included), ``--size small`` (the former quick size; ``bench_storage.py``'s), the default (~30
minutes on CPU) and ``--size gpu`` (chosen automatically when CUDA is available).

The target is built by ``quality_target.py`` (its inputs made reproducible by ``quality_inputs.py``),
the sizes are in ``quality_sizes.py``, the steps (prompts, ``hsgen generate``, ``spectrain
train``/``export``/``eval``) in ``quality_steps.py``, one draw in ``quality_draw.py``, the peer in
``quality_peer.py`` and the paired statistics in ``quality_stats.py`` / ``quality_report.py``.
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
from quality_draw import DrawPlan, draft_name, run_draw  # noqa: E402
from quality_inputs import KERNELS, build_differences, environment, pin_kernels  # noqa: E402
from quality_peer import CPU_CHANGES, PEER_ALGORITHMS  # noqa: E402
from quality_report import summarize  # noqa: E402
from quality_sizes import SIZES  # noqa: E402
from quality_target import TargetError, TargetSpec, ensure_target, target_facts  # noqa: E402

log = logging.getLogger("bench_quality")

ALL_DRAFTS = ("dflash", "dspark", "eagle3", "baseline")


# --------------------------------------------------------------------------- arguments


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add = parser.add_argument
    add(
        "--quick",
        action="store_true",
        help="Smallest size: the whole path in under a minute on 2 CPU cores (low tau figures).",
    )
    add("--size", choices=sorted(SIZES), default=None, help="Size (default: gpu with CUDA, else default).")
    add("--device", default=None, help="Torch device (default: cuda if available, else cpu).")
    add(
        "--cache",
        type=Path,
        default=None,
        help="Where trained targets are kept (default: $HSGEN_CACHE/bench-quality).",
    )
    add(
        "--target",
        type=Path,
        default=None,
        help="Use this built target (a directory bench_quality.py built: its bench_target.json and the weights it "
        "records) instead of the cache's; the size's data and drafts around it.",
    )
    add(
        "--kernels",
        choices=sorted(KERNELS),
        default="avx2",
        help="CPU code paths of every step: avx2 (meant to give the same bits on any x86-64 CPU with AVX2) or "
        "native (AVX-512/AMX where the CPU has them: faster, other bits).",
    )
    add(
        "--work",
        type=Path,
        default=None,
        help="Working directory (default: a temporary one, removed at the end).",
    )
    add("--keep", action="store_true", help="Keep the working directory (store, checkpoints, drafts).")
    add(
        "--only",
        choices=list(ALL_DRAFTS),
        default=None,
        help="Train and evaluate this draft only (ablations; the last line then describes it alone; with --peer, "
        "the peer's draft of the same algorithm beside it).",
    )
    add(
        "--drafts",
        default=None,
        help="Comma-separated drafts to train and evaluate (default: all of dflash,dspark,eagle3,baseline, with or "
        "without --peer; the peer trains dflash, dspark and eagle3).",
    )
    add(
        "--train-args",
        default="",
        help="Extra `spectrain train` flags for our trained draft(s), e.g. '--optimizer muon --lr 1e-3'.",
    )
    add(
        "--recipe",
        choices=["ours", "speculators"],
        default="ours",
        help="Train with our defaults, or with speculators 0.9.0's recipe expressed as our options.",
    )
    add("--tag", default="", help="Suffix of this run's train/draft directories under --work.")
    add(
        "--threads",
        type=int,
        default=1,
        help="Torch threads of every step (1: fastest on a shared or busy machine; the core count on an idle one).",
    )
    add(
        "--peer",
        action="store_true",
        help="Also train speculators 0.9.0's own DFlash, DSpark and Eagle3 (its trainer) on the same samples and hidden "
        "states and report ours minus the peer, paired per prompt.",
    )
    add(
        "--seeds",
        default="0",
        help="Comma-separated data draws: each seed draws the training windows and evaluation prompts anew "
        "(default 0; several: each under <work>/seed-N, figures are means over them).",
    )
    add(
        "--no-compute-match",
        action="store_true",
        help="With --peer: train ours for all its steps even where its counted FLOPs pass the peer's (by default "
        "a draft the peer also trains stops at the peer's compute: --max-steps from a 10-step probe).",
    )
    add(
        "--merge",
        type=Path,
        nargs="+",
        default=None,
        metavar="RESULTS",
        help="Summarize the draws of these results*.json files (runs of the same plan on other seeds, e.g. one "
        "process or machine per seed) as one run: per-draw lines, pooled CI, sweep and the last line; trains nothing.",
    )
    add(
        "--lrs",
        default=None,
        help="Comma-separated learning rates: train every draft of both sides at each (a sweep; each side's "
        "reported figure is its best rate by mean tau over the draws).",
    )
    return parser  # fmt: skip


def results_path(work: Path, suffix: str) -> Path:
    """``<work>/results<suffix>.json``, or ``results<suffix>-N.json`` with the first free ``N`` when an
    earlier run sharing ``--work`` and ``--tag`` left one: its results are kept, never overwritten."""
    out, n = work / f"results{suffix}.json", 2
    while out.exists():
        out, n = work / f"results{suffix}-{n}.json", n + 1
    return out


def _floats(text: str | None, flag: str) -> tuple[float | None, ...]:
    if not text:
        return (None,)
    try:
        return tuple(float(x) for x in text.split(","))
    except ValueError:
        raise SystemExit(f"{flag}: not a comma-separated list of numbers: {text!r}") from None


def _seeds(text: str) -> list[int]:
    try:
        seeds = [int(x) for x in text.split(",")]
    except ValueError:
        raise SystemExit(f"--seeds: not a comma-separated list of integers: {text!r}") from None
    if len(set(seeds)) != len(seeds):
        raise SystemExit(f"--seeds: a seed given twice: {text!r}")
    return seeds


def _plan(args) -> DrawPlan:
    if args.only:
        ours = (args.only,)
    elif args.drafts:
        ours = tuple(x.strip() for x in args.drafts.split(",") if x.strip())
        unknown = sorted(set(ours) - set(ALL_DRAFTS))
        if unknown:
            raise SystemExit(f"--drafts: no such draft {', '.join(unknown)} (known: {', '.join(ALL_DRAFTS)})")
    else:
        ours = ALL_DRAFTS
    peer = tuple(a for a in PEER_ALGORITHMS if a in ours) if args.peer else ()
    if args.peer and not peer:
        raise SystemExit(f"--peer: the peer trains {', '.join(PEER_ALGORITHMS)}, none of {', '.join(ours)}")
    return DrawPlan(ours=ours, peer=peer, lrs=_floats(args.lrs, "--lrs"), recipe=args.recipe,
                    train_args=args.train_args, tag=args.tag, keep_peer_data=args.keep,
                    match_compute=bool(peer) and not args.no_compute_match)  # fmt: skip


# --------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s: %(message)s")
    if args.merge:
        return _merge(args)
    if not (args.device or "").startswith("cuda"):
        pin_kernels(args.kernels)
    plan, seeds = _plan(args), _seeds(args.seeds)

    import torch

    from hsgen.hf.tiny import default_cache_dir

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
    try:
        target = args.target or ensure_target(cache, size.target, device)
        try:
            facts = target_facts(target)
        except TargetError as e:
            raise SystemExit(f"--target: {e}") from None
        if TargetSpec(**facts["spec"]) != size.target:
            log.info(
                "target: %s is not the %s size's target; the size's data and drafts around it",
                target,
                size_name,
            )
            size = dataclasses.replace(size, target=TargetSpec(**facts["spec"]))
        target_s = time.perf_counter() - t_start
        draws = []
        for seed in seeds:
            draw_dir = work if seeds == [0] else work / f"seed-{seed}"
            draw_dir.mkdir(parents=True, exist_ok=True)
            log.info("draw: seed %d in %s", seed, draw_dir)
            draws.append(run_draw(plan, seed, draw_dir, target, facts, size, device))
        lines, figures = summarize(draws, plan)
        env = environment(device)
        elsewhere = build_differences(facts.get("built_with", {}), env)
        if elsewhere:
            log.warning("target: built under another environment than this one: %s", elsewhere)
        hashes = {k: draws[0]["inputs"][k] if len(draws) == 1 else [d["inputs"][k] for d in draws]
                  for k in draws[0]["inputs"]}  # fmt: skip
        details = {
            "size": size_name, "device": device, "seeds": seeds, "inputs": hashes, "environment": env,
            "target_built_elsewhere": elsewhere, "target_dir": str(target), "target": facts,
            "recipe": args.recipe, "train_args": args.train_args, "plan": dataclasses.asdict(plan),
            "peer_cpu_changes": CPU_CHANGES if plan.peer and not device.startswith("cuda") else {},
            "summary": figures, "draws": draws,
            "timings_s": {"target": round(target_s, 1), "total": round(time.perf_counter() - t_start, 1)},
        }  # fmt: skip
        suffix = "".join(f"-{x}" for x in (args.tag or ("speculators" if args.recipe == "speculators" else ""),
                                           args.only or "") if x)  # fmt: skip
        out = results_path(work, suffix)
        out.write_text(json.dumps(details, indent=2) + "\n")
        log.info("results: %s", out)
        _print_draws(draws)
        for line in lines:
            print(line, file=sys.stderr)
        final = _final(args, draws, figures, hashes, seeds)
        print(json.dumps(final))
        return 0 if final["exact_match"] else 1
    finally:
        if args.work is None and not args.keep:
            shutil.rmtree(work, ignore_errors=True)
        elif args.keep or args.work:
            log.info("kept %s", work)


def _merge(args) -> int:
    """``--merge``: the draws of several results files, summarized as one run of their common plan.

    Files of other seeds add draws; files of the same seed with other learning rates (a sweep
    extended later) add those rates' drafts to that seed's draw, on the same inputs."""
    plans, envs, by_seed = [], [], {}
    for path in args.merge:
        try:
            details = json.loads(path.read_text())
            plan = details["plan"]
            plans.append(DrawPlan(**{k: tuple(v) if isinstance(v, list) else v for k, v in plan.items()}))
            draws = details["draws"]
            envs.append(details.get("environment"))
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise SystemExit(f"--merge: {path}: not a bench_quality results file ({e})") from None
        for d in draws:
            seen = by_seed.setdefault(d["seed"], {**d, "eval": {}, "train": {}})
            if seen["inputs"] != d["inputs"]:
                raise SystemExit(
                    f"--merge: {path}: seed {d['seed']} was drawn on other inputs than in an earlier file"
                )
            twice = sorted(set(seen["eval"]) & set(d["eval"]))
            if twice:
                raise SystemExit(f"--merge: {path}: seed {d['seed']}'s {', '.join(twice)} is in two files")
            seen["eval"].update(d["eval"])
            seen["train"].update(d["train"])
    keys = [dataclasses.replace(p, tag="", keep_peer_data=False, lrs=()) for p in plans]
    if any(k != keys[0] for k in keys):
        raise SystemExit(f"--merge: the files ran different plans: {sorted({str(k) for k in keys})}")
    rates = {lr for p in plans for lr in p.lrs}
    if None in rates and len(rates) > 1:
        raise SystemExit("--merge: some files swept learning rates and some did not")
    plan = dataclasses.replace(plans[0], lrs=tuple(sorted(rates, key=lambda x: x or 0.0)))
    draws = [by_seed[s] for s in sorted(by_seed)]
    wanted = [draft_name(a, side, lr) for side, algs in (("ours", plan.ours), ("peer", plan.peer)) for a in algs
              for lr in (plan.lrs if a != "baseline" else (None,))]  # fmt: skip
    for d in draws:
        missing = [n for n in wanted if n not in d["eval"]]
        if missing:
            raise SystemExit(f"--merge: seed {d['seed']} has no {', '.join(missing)} in these files")
    lines, figures = summarize(draws, plan)
    hashes = {k: [d["inputs"][k] for d in draws] for k in draws[0]["inputs"]}
    _print_draws(draws)
    for line in lines:
        print(line, file=sys.stderr)
    if any(e != envs[0] for e in envs):
        log.warning("--merge: the files were run under different environments: %s", envs)
    args.only = None
    final = _final(args, draws, figures, hashes, sorted(by_seed))
    print(json.dumps(final))
    return 0 if final["exact_match"] else 1


def _print_draws(draws: list[dict]) -> None:
    for d in draws:
        for name, r in d["eval"].items():
            rates = " ".join(f"{x:.2f}" for x in r["acceptance_rate"])
            print(f"seed {d['seed']} {name:>12}: tau {r['tau']:.3f}  K={r['num_speculative_tokens']}  "
                  f"per-position {rates}", file=sys.stderr)  # fmt: skip


def _final(args, draws: list[dict], figures: dict, hashes: dict, seeds: list[int]) -> dict:
    """The last stdout line: today's keys, the peer's and the sweep's when asked for, the hashes."""
    extra = {"seeds": seeds} if seeds != [0] else {}
    if not args.only:
        return {**figures, **extra, **hashes}
    name = args.only
    rows = [
        d["eval"][name if args.lrs is None else next(k for k in d["eval"] if k.startswith(name))]
        for d in draws
    ]
    trains = [d["train"].get(name, {}) for d in draws]
    final = {"draft": name, "tag": args.tag, "train_args": args.train_args, "tau": figures[f"tau_{name}"],
             "acceptance_rate": [round(sum(r["acceptance_rate"][i] for r in rows) / len(rows), 3)
                                 for i in range(len(rows[0]["acceptance_rate"]))],
             "train_gflop": round(sum(t.get("train_flops", 0.0) for t in trains) / len(trains) / 1e9, 1),
             "step_time_s": trains[0].get("step_time_s"), "train_seconds": trains[0].get("train_seconds"),
             "exact_match": figures["exact_match"]}  # fmt: skip
    for key in ("peer_tau", "peer_train_gflop", "diff", "diff_ci", "min_diff", "diffs"):
        src = f"{key}_{name}" if not key.startswith("diff_ci") else f"diff_{name}_ci"
        if src in figures:
            final[key] = figures[src]
    if "sweep" in figures:
        final["sweep"] = figures["sweep"]
    return {**final, **extra, **hashes}


if __name__ == "__main__":
    sys.exit(main())
