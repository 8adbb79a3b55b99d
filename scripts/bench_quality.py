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
``exact_match``. Ablations: ``--only dflash --train-args '--optimizer muon' --tag muon --work DIR``
trains and evaluates one draft with extra ``spectrain train`` flags against the store kept in
``DIR`` (the last line then holds that draft's ``tau``, per-position acceptance, training FLOPs
and CPU step time). Sizes: ``--quick`` (a tiny target on an eighth of the corpus, 32 prompts, 4
evaluation prompts; every command runs in this process: under a minute on 2 CPU cores, target
included), ``--size small`` (the former quick size; ``bench_storage.py``'s), the default (~30
minutes on CPU) and ``--size gpu`` (chosen automatically when CUDA is available).

The target is built by ``quality_target.py``, the sizes are in ``quality_sizes.py`` and the steps
(prompts, ``hsgen generate``, ``spectrain train``/``export``/``eval``) in ``quality_steps.py``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import shlex
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from quality_inputs import KERNELS, build_differences, environment, input_hashes, pin_kernels  # noqa: E402
from quality_sizes import SIZES, SPECULATORS_RECIPE, draft_layers  # noqa: E402
from quality_steps import (  # noqa: E402
    evaluate_draft,
    export_untrained,
    generate_hidden_states,
    make_prompts,
    train_draft,
)
from quality_target import TargetError, TargetSpec, ensure_target, target_facts  # noqa: E402

log = logging.getLogger("bench_quality")


# --------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="Smallest size: the whole path in under a minute on 2 CPU cores (low tau figures).",
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
        "--target",
        type=Path,
        default=None,
        help="Use this built target (a directory bench_quality.py built: its bench_target.json and the "
        "weights it records) instead of the cache's; the size's data and drafts around it.",
    )
    parser.add_argument(
        "--kernels",
        choices=sorted(KERNELS),
        default="avx2",
        help="CPU code paths of every step: avx2 (the same bits on any x86-64 CPU with AVX2) or native "
        "(AVX-512/AMX where the CPU has them: faster, other bits).",
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
        choices=["dflash", "dspark", "eagle3", "baseline"],
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
    if not (args.device or "").startswith("cuda"):
        pin_kernels(args.kernels)

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
        timings["target"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        train_jsonl, eval_jsonl = make_prompts(target, size, work, device)
        timings["prompts"] = time.perf_counter() - t0
        L = size.target.num_hidden_layers
        dflash_aux, eagle_aux = draft_layers(L)
        store_layers = sorted({*dflash_aux, *eagle_aux, L})
        t0 = time.perf_counter()
        store = generate_hidden_states(target, train_jsonl, store_layers, work, device, size.in_process)
        timings["hidden_states"] = time.perf_counter() - t0
        results: dict[str, dict] = {}
        train_summaries = {}
        drafts = {}
        trained = [a for a in ("dflash", "dspark", "eagle3") if args.only in (None, a)]
        tag = args.tag or ("speculators" if args.recipe == "speculators" else "")
        for algorithm in trained:
            aux = eagle_aux if algorithm == "eagle3" else dflash_aux
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
        hashes = input_hashes(facts, train_jsonl, eval_jsonl)
        env = environment(device)
        elsewhere = build_differences(facts.get("built_with", {}), env)
        if elsewhere:
            log.warning("target: built under another environment than this one: %s", elsewhere)
        details = {
            "size": size_name,
            "device": device,
            "inputs": hashes,
            "environment": env,
            "target_built_elsewhere": elsewhere,
            "target_dir": str(target),
            "target": facts,
            "layers": {
                "dflash": dflash_aux,
                "dspark": dflash_aux,
                "eagle3": eagle_aux,
                "store": store_layers,
            },
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
                     "train_seconds": t.get("train_seconds"), "exact_match": exact, **hashes}  # fmt: skip
        else:
            final = {
                "tau_dflash": round(results["dflash"]["tau"], 4),
                "tau_dspark": round(results["dspark"]["tau"], 4),
                "tau_eagle3": round(results["eagle3"]["tau"], 4),
                "tau_baseline": round(results["baseline"]["tau"], 4),
                "exact_match": exact,
                **hashes,
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
