"""Pieces both drafts use: draft vocabulary maps, the distillation loss, acceptance metrics."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def build_vocab_map(counts: torch.Tensor, draft_vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(d2t, t2d)`` keeping the ``draft_vocab_size`` most frequent target tokens.

    Ties (and tokens never seen, when fewer than ``draft_vocab_size`` were) go to the lower id.
    ``d2t`` int64 ``[draft_vocab]``: target id = draft id + ``d2t[draft id]``; ``t2d`` bool
    ``[target_vocab]``: True for tokens in the draft vocabulary. Draft ids are in target-id order.
    """
    vocab = int(counts.shape[0])
    if not 0 < draft_vocab_size <= vocab:
        raise ValueError(f"draft_vocab_size must be in 1..{vocab}, got {draft_vocab_size}")
    counts = counts.to(torch.float64)
    # stable descending sort by count -> lower ids win ties
    order = torch.sort(-counts, stable=True).indices
    keep = torch.sort(order[:draft_vocab_size]).values
    d2t = keep - torch.arange(draft_vocab_size, dtype=torch.int64)
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[keep] = True
    return d2t.to(torch.int64), t2d


def draft_to_target_ids(d2t: torch.Tensor) -> torch.Tensor:
    """Target ids of the draft vocabulary, ``arange + d2t``."""
    return torch.arange(d2t.shape[0], device=d2t.device, dtype=torch.int64) + d2t


def distill_loss(draft_logits: torch.Tensor, target_logits: torch.Tensor, mode: str) -> torch.Tensor:
    """Per-row loss ``[N]``: cross-entropy against softmax(target) (``soft``) or its argmax (``hard``)."""
    logp = F.log_softmax(draft_logits.float(), dim=-1)
    if mode == "soft":
        p = F.softmax(target_logits.float(), dim=-1)
        return -(p * logp).sum(-1)
    if mode == "hard":
        return F.nll_loss(logp, target_logits.argmax(-1), reduction="none")
    raise ValueError(f"unknown target_mode {mode!r} (soft | hard)")


def chain_metrics(correct: torch.Tensor, valid: torch.Tensor) -> dict[str, torch.Tensor]:
    """Accuracy per draft position and accepted-length sums for chains ``[N, K]``.

    ``correct[n, k]``: the draft's k-th token of chain n equals the verifier's greedy token;
    ``valid[n, k]``: that position is trained (loss mask, inside the document). A chain's
    accepted length counts correct positions from the first up to the first wrong or invalid
    one; only chains whose first position is valid count. The tau estimate is
    ``1 + accepted_sum / chains`` (the verifier's bonus token always counts).
    """
    correct = correct.bool() & valid.bool()
    acc_correct = correct.sum(0).to(torch.float64)
    acc_total = valid.bool().sum(0).to(torch.float64)
    run = torch.cumprod(correct.to(torch.int64), dim=1).sum(1)
    chains = valid[:, 0].bool()
    return {
        "acc_correct": acc_correct,
        "acc_total": acc_total,
        "accepted_sum": run[chains].sum().to(torch.float64),
        "chains": chains.sum().to(torch.float64),
    }


def loss_decay_weights(num: int, gamma: float, device=None) -> torch.Tensor:
    """DFlash's per-position weights ``exp(-(k - 1) / gamma)`` for ``k = 1..num``."""
    k = torch.arange(1, num + 1, dtype=torch.float32, device=device)
    return torch.exp(-(k - 1) / gamma)


def default_dflash_gamma(block_size: int) -> float:
    """Loss-decay gamma of the DFlash paper: 7 for B=16, 5 for B=10, 4 for B=8 (interpolated otherwise)."""
    table = {16: 7.0, 10: 5.0, 8: 4.0}
    if block_size in table:
        return table[block_size]
    pts = sorted(table.items())
    if block_size <= pts[0][0]:
        return max(1.0, pts[0][1] * block_size / pts[0][0])
    if block_size >= pts[-1][0]:
        return pts[-1][1] * block_size / pts[-1][0]
    for (b0, g0), (b1, g1) in zip(pts, pts[1:], strict=False):
        if b0 <= block_size <= b1:
            return g0 + (g1 - g0) * (block_size - b0) / (b1 - b0)
    return 7.0
