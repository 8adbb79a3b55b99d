"""Pieces both drafts use: draft vocabulary maps, the distillation loss, acceptance metrics."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def build_vocab_map(counts: torch.Tensor, draft_vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(d2t, t2d)`` keeping the ``draft_vocab_size`` most frequent target tokens.

    Ties (and tokens never seen, when fewer than ``draft_vocab_size`` were) go to the lower id.
    ``d2t`` int64 ``[draft_vocab]``: target id = draft id + ``d2t[draft id]``; ``t2d`` bool
    ``[target_vocab]``: True for tokens in the draft vocabulary. Draft ids are in target-id order.
    Both live on ``counts``' device.
    """
    vocab = int(counts.shape[0])
    if not 0 < draft_vocab_size <= vocab:
        raise ValueError(f"draft_vocab_size must be in 1..{vocab}, got {draft_vocab_size}")
    counts = counts.to(torch.float64)
    # stable descending sort by count -> lower ids win ties
    order = torch.sort(-counts, stable=True).indices
    keep = torch.sort(order[:draft_vocab_size]).values
    # on the counts' device, whatever the default device is (a draft is often built under one)
    d2t = keep - torch.arange(draft_vocab_size, dtype=torch.int64, device=keep.device)
    t2d = torch.zeros(vocab, dtype=torch.bool, device=keep.device)
    t2d[keep] = True
    return d2t.to(torch.int64), t2d


def draft_to_target_ids(d2t: torch.Tensor) -> torch.Tensor:
    """Target ids of the draft vocabulary, ``arange + d2t``."""
    return torch.arange(d2t.shape[0], device=d2t.device, dtype=torch.int64) + d2t


def stored_target_ids(
    target_ids: torch.Tensor, draft_ids: torch.Tensor | None, vocab_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids, known)`` of stored verifier targets (a store of target ids; -1 = none) in the draft's
    vocabulary: ``ids`` index the draft's rows (0 where not ``known``), ``known`` is False where no
    target is stored or the verifier's argmax is outside a reduced draft vocabulary (a token the
    draft could never propose, so no hard target it can learn)."""
    known = target_ids >= 0
    ids = target_ids.clamp_min(0)
    if draft_ids is None:
        return ids, known
    inverse = torch.full((vocab_size,), -1, dtype=torch.int64, device=target_ids.device)
    inverse[draft_ids] = torch.arange(draft_ids.shape[0], device=target_ids.device)
    mapped = inverse[ids]
    return mapped.clamp_min(0), known & (mapped >= 0)


TARGET_MODES = ("soft", "hard")


def eager_vocab_loss(
    hidden: torch.Tensor,
    head_weight: torch.Tensor,
    target_hidden: torch.Tensor | None = None,
    target_head_weight: torch.Tensor | None = None,
    mode: str = "hard",
    *,
    targets=None,
    target_softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every vocabulary-sized computation of a training step: the draft's head, the verifier's
    head and the per-row loss between them (the eager reference of
    :func:`spectrain.models.vocab_loss.vocab_loss`, which the drafts call).

    Args:
        hidden: ``[N, H]`` the draft's final (normed) states; gradients flow to it.
        head_weight: ``[V, H]`` the draft's output rows (trainable or frozen).
        target_hidden: ``[N, H]`` the verifier's last-layer states after its final norm.
        target_head_weight: ``[V, H]`` the verifier's LM-head rows of the same ``V`` tokens.
        mode: ``soft``: KL(verifier || draft) over the ``V`` rows; ``hard``: cross-entropy
            against the verifier's argmax over the ``V`` rows.
        targets: the verifier's side computed beforehand
            (:class:`~spectrain.models.vocab_loss.VerifierTargets`), in place of the two above.
        target_softcap: the verifier's ``final_logit_softcapping`` on the logits formed here
            (``cap * tanh(logits / cap)``; None: none).

    Returns:
        ``(loss [N] float32, draft argmax [N], verifier argmax [N])``; argmaxes index the ``V``
        rows. Nothing ``[N, V]``-sized is returned, so the body may be chunked or fused.
    """
    if mode not in TARGET_MODES:
        raise ValueError(f"unknown target_mode {mode!r} (soft | hard)")
    autocast = torch.is_autocast_enabled(hidden.device.type)
    logits = F.linear(hidden, head_weight if autocast else head_weight.to(hidden.dtype))
    acc = torch.promote_types(logits.dtype, torch.float32)
    logp = F.log_softmax(logits.to(acc), dim=-1)
    if targets is not None:
        target_ids = targets.ids
        target = None
        if mode == "soft":
            target = targets.logits if targets.index is None else targets.logits[targets.index]
    else:
        with torch.no_grad():
            th = target_hidden if autocast else target_hidden.to(target_head_weight.dtype)
            target = F.linear(th, target_head_weight)
            if target_softcap:
                target = torch.tanh(target / target_softcap) * target_softcap
        target_ids = target.argmax(-1)
    if mode == "soft":
        p = F.softmax(target.to(acc), dim=-1)
        loss = F.kl_div(logp, p, reduction="none").sum(-1)
    else:
        loss = F.nll_loss(logp, target_ids, reduction="none")
    return loss, logits.detach().argmax(-1), target_ids


def dpace_weights(loss: torch.Tensor, valid: torch.Tensor, alpha: float) -> torch.Tensor:
    """D-PACE per-position weights for blocks ``[N, K]`` (no gradient).

    With the smoothed confidence ``c_k = (1 - alpha) * exp(-loss_k) + alpha`` (1 where not
    valid), position ``k`` weighs the expected number of accepted tokens it gates:
    ``w_k = sum_{j >= k} valid_j * prod_{i <= j} c_i`` (0 where not valid).
    """
    if not 0.0 < alpha <= 1.0:
        raise ValueError(f"dpace_alpha must be in (0, 1], got {alpha}")
    with torch.no_grad():
        v = valid.to(torch.float32)
        c = (1.0 - alpha) * torch.exp(-(loss.detach().float() * v)) + alpha
        c = torch.where(v > 0, c, torch.ones_like(c))
        prefix = torch.cumprod(c, dim=-1)
        return torch.flip(torch.cumsum(torch.flip(prefix * v, dims=[-1]), dim=-1), dims=[-1]) * v


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
    return {  # masked sums, not boolean indexing: fixed shapes, no host-device sync
        "acc_correct": acc_correct,
        "acc_total": acc_total,
        "accepted_sum": (run * chains).sum().to(torch.float64),
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


def greedy_reach(agree: torch.Tensor) -> torch.Tensor:
    """``[N, K]`` bool: whether each block's slot ``k`` is reached through the verifier's own greedy
    tokens, given ``agree [N, K]`` (slot ``k``'s label token is the verifier's greedy choice before it).

    Slot ``k`` is reached iff every earlier slot's label agrees (a served block is accepted up to it);
    the first slot always is.
    """
    path = torch.cumprod(agree.to(torch.int8), dim=1).bool()
    return torch.cat([torch.ones_like(path[:, :1]), path[:, :-1]], dim=1)
