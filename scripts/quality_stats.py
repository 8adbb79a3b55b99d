"""Paired comparisons of two drafts' acceptance on the same evaluation prompts.

tau over a set of prompts is total emitted tokens over total verification steps. A paired
difference compares two drafts on the same prompts (``spectrain eval``'s ``per_prompt`` rows, by
id); its 95% confidence interval comes from a bootstrap over the prompts (the same resampled prompts
for both drafts, tau recomputed on each resample). Over several data draws, the mean of the draws'
differences gets a stratified bootstrap (prompts resampled within each draw). Deterministic: the
resampling has a fixed seed. Not a benchmark itself.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

RESAMPLES = 2000


def tau(rows: Sequence[dict]) -> float:
    """Emitted tokens per verification step over ``rows`` (``new_tokens``, ``steps`` each)."""
    steps = sum(r["steps"] for r in rows)
    return sum(r["new_tokens"] for r in rows) / steps if steps else 0.0


def _pairs(ours: Sequence[dict], peer: Sequence[dict]) -> list[tuple[dict, dict]]:
    theirs = {r["id"]: r for r in peer}
    pairs = [(r, theirs[r["id"]]) for r in ours if r["id"] in theirs]
    if not pairs or len(pairs) != len(ours) or len(pairs) != len(peer):
        raise ValueError(f"the two evaluations are not of the same prompts ({len(ours)} and {len(peer)} rows, "
                         f"{len(pairs)} shared ids)")  # fmt: skip
    return pairs


def _diff(pairs: Sequence[tuple[dict, dict]]) -> float:
    return tau([a for a, _ in pairs]) - tau([b for _, b in pairs])


def _interval(samples: list[float]) -> tuple[float, float]:
    samples = sorted(samples)
    return samples[int(0.025 * len(samples))], samples[min(len(samples) - 1, int(0.975 * len(samples)))]


def paired(ours: Sequence[dict], peer: Sequence[dict], resamples: int = RESAMPLES, seed: int = 0) -> dict:
    """``{"diff", "ci": [lo, hi], "prompts"}``: tau(ours) - tau(peer) on the shared prompts."""
    pairs = _pairs(ours, peer)
    rng = random.Random(seed)
    boot = [_diff([rng.choice(pairs) for _ in pairs]) for _ in range(resamples)]
    lo, hi = _interval(boot)
    return {"diff": _diff(pairs), "ci": [lo, hi], "prompts": len(pairs)}


def pooled(draws: Sequence[tuple[Sequence[dict], Sequence[dict]]], resamples: int = RESAMPLES,
           seed: int = 0) -> dict:  # fmt: skip
    """``{"diff", "ci", "min_diff", "draws"}`` over several draws' ``(ours rows, peer rows)``: the
    mean of the per-draw differences with a bootstrap that resamples prompts within each draw,
    and the worst draw's difference."""
    per = [_pairs(a, b) for a, b in draws]
    diffs = [_diff(p) for p in per]
    rng = random.Random(seed)
    boot = [sum(_diff([rng.choice(p) for _ in p]) for p in per) / len(per) for _ in range(resamples)]
    lo, hi = _interval(boot)
    return {"diff": sum(diffs) / len(diffs), "ci": [lo, hi], "min_diff": min(diffs), "draws": len(per)}
