"""The quality benchmark's summary over its draws: ours against the peer, paired, per draw and pooled.

``summarize(draws, plan)`` turns the draws of ``quality_draw.run_draw`` into the lines printed on
stderr (per draw and algorithm: ours, the peer, the per-prompt paired difference with its 95%
bootstrap CI, each side's training compute, exact_match; then the mean over the draws) and the
last stdout line's object. With a learning-rate sweep, each side's rate is the one with the best
mean tau over the draws, and the sweep's taus are in the object. Not a benchmark itself.
"""

from __future__ import annotations

from quality_draw import DrawPlan, draft_name
from quality_stats import paired, pooled


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def _best_lr(draws: list[dict], algorithm: str, side: str, lrs: tuple) -> float | None:
    """The swept rate with the best mean tau over the draws (``None`` when nothing was swept)."""
    if lrs == (None,):
        return None
    return max(lrs, key=lambda lr: _mean([d["eval"][draft_name(algorithm, side, lr)]["tau"] for d in draws]))


def _compute(t: dict) -> str:
    gflop = t.get("train_flops", 0.0) / 1e9
    dense = t.get("train_flops_dense_attention")
    return (f"{t.get('step')} steps, {gflop:.1f} GFLOP" + (f" ({dense / 1e9:.1f} with dense attention)" if dense else "")
            + f", {t.get('step_time_s')} s/step, {t.get('cpu_seconds')} CPU s")  # fmt: skip


def summarize(draws: list[dict], plan: DrawPlan) -> tuple[list[str], dict]:
    """``(stderr lines, the final object's figures)``."""
    lines: list[str] = []
    final: dict = {}
    ours_names = {
        a: draft_name(a, "ours", _best_lr(draws, a, "ours", plan.lrs)) for a in plan.ours if a != "baseline"
    }
    if "baseline" in plan.ours:
        ours_names["baseline"] = "baseline"
    peer_names = {a: draft_name(a, "peer", _best_lr(draws, a, "peer", plan.lrs)) for a in plan.peer}
    for algorithm, name in ours_names.items():
        final[f"tau_{algorithm}"] = round(_mean([d["eval"][name]["tau"] for d in draws]), 4)
        if algorithm in ours_names and algorithm != "baseline":
            t = [d["train"][name] for d in draws]
            final[f"train_gflop_{algorithm}"] = round(_mean([x.get("train_flops", 0.0) for x in t]) / 1e9, 1)
    for algorithm, name in peer_names.items():
        final[f"peer_tau_{algorithm}"] = round(_mean([d["eval"][name]["tau"] for d in draws]), 4)
        t = [d["train"][name] for d in draws]
        final[f"peer_train_gflop_{algorithm}"] = round(_mean([x.get("train_flops", 0.0) for x in t]) / 1e9, 1)
        if algorithm not in ours_names:
            continue
        ours = ours_names[algorithm]
        ratios = [d["train"][ours].get("train_flops", 0.0) / d["train"][name]["train_flops"] for d in draws
                  if d["train"][name].get("train_flops")]  # fmt: skip
        if ratios:
            final[f"compute_ratio_{algorithm}"] = round(max(ratios), 4)
        per_draw = []
        for d in draws:
            p = paired(d["eval"][ours]["per_prompt"], d["eval"][name]["per_prompt"])
            per_draw.append(p)
            exact = d["eval"][ours]["exact_match"] and d["eval"][name]["exact_match"]
            lines.append(
                f"seed {d['seed']} {algorithm:>7}: ours {d['eval'][ours]['tau']:.3f}  peer {d['eval'][name]['tau']:.3f}"
                f"  diff {p['diff']:+.3f} (95% CI {p['ci'][0]:+.3f}..{p['ci'][1]:+.3f}, {p['prompts']} prompts)"
                f"  exact_match {str(exact).lower()}"
                f"  | ours {_compute(d['train'][ours])}  | peer {_compute(d['train'][name])}"
            )
        pool = pooled([(d["eval"][ours]["per_prompt"], d["eval"][name]["per_prompt"]) for d in draws])
        lines.append(
            f"mean over {len(draws)} draw(s) {algorithm}: ours {final[f'tau_{algorithm}']:.3f}  peer "
            f"{final[f'peer_tau_{algorithm}']:.3f}  diff {pool['diff']:+.3f} (95% CI {pool['ci'][0]:+.3f}.."
            f"{pool['ci'][1]:+.3f})  worst draw {pool['min_diff']:+.3f}"
        )
        final[f"diff_{algorithm}"] = round(pool["diff"], 4)
        final[f"diff_{algorithm}_ci"] = [round(x, 4) for x in pool["ci"]]
        final[f"min_diff_{algorithm}"] = round(pool["min_diff"], 4)
        final[f"diffs_{algorithm}"] = [round(p["diff"], 4) for p in per_draw]
    if plan.lrs != (None,):
        sweep: dict = {}
        for side, algorithms in (("ours", [a for a in plan.ours if a != "baseline"]), ("peer", plan.peer)):
            for algorithm in algorithms:
                taus = {f"{lr:g}": round(_mean([d["eval"][draft_name(algorithm, side, lr)]["tau"] for d in draws]), 4)
                        for lr in plan.lrs}  # fmt: skip
                best = _best_lr(draws, algorithm, side, plan.lrs)
                sweep[f"{side}_{algorithm}"] = {"tau": taus, "best_lr": best}
                lines.append(f"lr sweep {side} {algorithm}: " + "  ".join(f"{k}: {v:.3f}" for k, v in taus.items())
                             + f"  -> {best:g}")  # fmt: skip
        final["sweep"] = sweep
    final["exact_match"] = all(r["exact_match"] for d in draws for r in d["eval"].values())
    return lines, final
