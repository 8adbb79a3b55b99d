"""DSpark's distribution-matching loss, chunked over rows so ``[rows, vocabulary]`` never exists whole.

One row is one predicting slot. Its draft logits are ``h @ W^T + u @ W2^T``: the frozen
vocabulary head ``W`` over the slot's state ``h`` and the Markov head's ``W2`` over its feature
``u`` (the Markov bias rides on the head as ``r`` extra columns). The row's loss is a weighted mix
(:data:`LOSS_TERMS`) of cross-entropy on the verifier's argmax,
KL(verifier || draft) and total variation ``1 - sum(min(p, q))``; ``hard`` targets replace the
verifier's distribution ``p`` by its argmax, one-hot.

:func:`mix_loss` returns the weighted sum of the rows' losses, the slot weights applied, the
rows' losses and their analytic acceptance ``1 - TV`` (detached: the confidence head's target),
and both argmaxes. The slot weights are computed inside, block by block (a chunk holds whole
blocks): ``exp(-j / gamma)`` for the ``j``-th predicting slot, or D-PACE from the row losses. So
every gradient is known once the forward has run: it computes, chunk by chunk, d total / d h,
d total / d u and d total / d W2 (fp32 accumulation), and keeps nothing ``[rows, V]``-sized; the
backward scales them by the incoming scalar gradient. Matmuls run in the autocast dtype when
autocast is on, the softmax math in fp32 (fp64 for fp64 inputs).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from spectrain.models.common import dpace_weights
from spectrain.models.vocab_loss import default_chunk_rows

LOSS_TERMS = ("ce", "kl_div", "tv")
"""Terms of :attr:`DSparkConfig.loss_mix` (speculators' names): cross-entropy on the verifier's
argmax, KL(verifier || draft), total variation ``1 - sum(min(p, q))``."""


def parse_loss_mix(value: Any, where: str = "loss_mix") -> dict[str, float]:
    """``{"term": weight}`` from a term name, a JSON object or a mapping (speculators' ``--loss-fn``)."""
    if isinstance(value, str):
        text = value.strip()
        value = {text: 1.0} if text in LOSS_TERMS else _json_object(text, where)
    if not isinstance(value, dict) or not value:
        raise ValueError(f"{where}: expected a term name ({', '.join(LOSS_TERMS)}) or a JSON object of "
                         f"term weights, got {value!r}")  # fmt: skip
    out: dict[str, float] = {}
    for name, weight in value.items():
        if name not in LOSS_TERMS:
            raise ValueError(f"{where}: unknown term {name!r} (known: {', '.join(LOSS_TERMS)})")
        if isinstance(weight, bool) or not isinstance(weight, int | float) or weight < 0:
            raise ValueError(f"{where}: the weight of {name!r} must be a number >= 0, got {weight!r}")
        out[name] = float(weight)
    if not any(out.values()):
        raise ValueError(f"{where}: every weight is 0")
    return out


def _json_object(text: str, where: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        raise ValueError(f"{where}: {text!r} is neither a term name ({', '.join(LOSS_TERMS)}) nor a JSON "
                         "object such as '{\"ce\": 0.1, \"tv\": 1.8}'") from None  # fmt: skip


@dataclasses.dataclass(frozen=True)
class SlotWeighting:
    """The per-slot loss weight of blocks of ``slots`` rows: ``exp-decay`` (``exp(-j / gamma)``) or
    ``dpace`` (:func:`~spectrain.models.common.dpace_weights` of the rows' mixed loss)."""

    slots: int
    kind: str = "exp-decay"
    gamma: float = 4.0
    alpha: float = 0.5

    def decay(self, dtype: torch.dtype, device) -> torch.Tensor:
        """``exp(-j / gamma)`` for ``j = 0..slots-1``."""
        return torch.exp(-torch.arange(self.slots, dtype=dtype, device=device) / self.gamma)

    def weights(self, rows: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """Weights ``[n * slots]`` of rows ``[n * slots]`` (0 where not ``valid``)."""
        K = self.slots
        if self.kind == "dpace":
            return dpace_weights(rows.view(-1, K), valid.view(-1, K), self.alpha).reshape(-1).to(rows.dtype)
        if self.kind != "exp-decay":
            raise ValueError(f"loss_weighting: {self.kind!r} is not exp-decay | dpace")
        return (self.decay(rows.dtype, rows.device)[None, :] * valid.view(-1, K).to(rows.dtype)).reshape(-1)


class MixLoss(NamedTuple):
    """What :func:`mix_loss` returns; only ``total`` carries a gradient."""

    total: torch.Tensor
    """``sum_r w_r * loss_r`` (a scalar)."""
    weights: torch.Tensor
    """``[N]`` the slot weights ``w`` (0 where not valid)."""
    rows: torch.Tensor
    """``[N]`` each row's mixed loss."""
    accept: torch.Tensor
    """``[N]`` ``1 - TV(p, q)`` = ``sum(min(p, q))``: the row's acceptance under rejection sampling
    (``q(argmax p)`` with hard targets: greedy acceptance)."""
    pred: torch.Tensor
    """``[N]`` the draft's argmax (Markov bias included), indexing the head's rows."""
    target: torch.Tensor
    """``[N]`` the verifier's argmax over the same rows."""


@dataclasses.dataclass
class _Plan:
    device_type: str
    draft_dtype: torch.dtype
    target_dtype: torch.dtype
    acc_dtype: torch.dtype
    mix: tuple[tuple[str, float], ...]
    soft: bool
    rows: int
    weighting: SlotWeighting
    softcap: float | None
    shared_head: bool = False
    """The verifier's head rows are the draft's (one tensor may enter an autograd function once)."""


def mix_loss(
    hidden: torch.Tensor,
    head_weight: torch.Tensor,
    valid: torch.Tensor,
    *,
    mix: dict[str, float],
    weighting: SlotWeighting,
    markov: torch.Tensor | None = None,
    markov_weight: torch.Tensor | None = None,
    target_hidden: torch.Tensor | None = None,
    target_head_weight: torch.Tensor | None = None,
    target_ids: torch.Tensor | None = None,
    mode: str = "soft",
    chunk_rows: int | None = None,
    target_softcap: float | None = None,
) -> MixLoss:
    """The weighted mixed loss of ``N`` rows (whole blocks of ``weighting.slots`` rows each).

    Args:
        hidden: ``[N, H]`` the slots' final (normed) states; gradients flow to it.
        head_weight: ``[V, H]`` the draft's output rows (frozen: no gradient is formed for them).
        valid: ``[N]`` bool: the rows that train.
        mix: ``{"ce" | "kl_div" | "tv": weight}``.
        markov: ``[N, r]`` the Markov head's features ``u`` (with ``markov_weight`` ``[V, r]``,
            both trained), or None.
        target_hidden: ``[N, H]`` the verifier's last-layer states after its final norm, with
            ``target_head_weight`` ``[V, H]`` its head over the same ``V`` tokens; or
        target_ids: ``[N]`` the verifier's argmax over the ``V`` rows (``hard`` only).
        mode: ``soft`` (the verifier's distribution) or ``hard`` (its argmax, one-hot).
        chunk_rows: rows per chunk (rounded down to whole blocks; default from the vocabulary).
        target_softcap: the verifier's ``final_logit_softcapping``.
    """
    if mode not in ("soft", "hard"):
        raise ValueError(f"unknown target_mode {mode!r} (soft | hard)")
    N, K = hidden.shape[0], weighting.slots
    if N % K or valid.shape != (N,):
        raise ValueError(f"mix_loss: {N} rows are not whole blocks of {K} with a [N] validity mask")
    if target_ids is None and (target_hidden is None or target_head_weight is None):
        raise ValueError("mix_loss needs target_ids or both target_hidden and target_head_weight")
    if target_ids is not None and mode == "soft":
        raise ValueError("soft targets need the verifier's final layer; this batch has target ids only")
    if (markov is None) != (markov_weight is None):
        raise ValueError("mix_loss: markov and markov_weight come together")
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type):
        dd = td = torch.get_autocast_dtype(device_type)
    else:
        dd = hidden.dtype
        td = target_head_weight.dtype if target_head_weight is not None else dd
    # soft targets hold about five fp32 [rows, V] tensors at once (DFlash's loss three): half the rows
    rows = chunk_rows or default_chunk_rows(head_weight.shape[0], device_type=device_type) // (
        2 if mode == "soft" else 1
    )
    rows = max(K, rows // K * K)
    plan = _Plan(device_type, dd, td, torch.promote_types(dd, torch.float32), tuple(sorted(mix.items())),
                 mode == "soft", rows, weighting, target_softcap)  # fmt: skip
    needs_grad = torch.is_grad_enabled() and (
        hidden.requires_grad or (markov is not None and (markov.requires_grad or markov_weight.requires_grad))
    )
    if target_head_weight is head_weight:
        plan.shared_head, target_head_weight = True, None
    args = (hidden, markov, markov_weight, head_weight, target_hidden, target_head_weight, target_ids, valid)
    if not needs_grad:
        with torch.no_grad(), torch.autocast(device_type, enabled=False):
            out = _chunks(plan, *args, want_grads=False)
        return MixLoss(*out[:6])
    return MixLoss(*_MixLossFunction.apply(*args, plan))


def _chunks(plan: _Plan, hidden, markov, markov_weight, head_weight, target_hidden, target_head_weight,
            target_ids, valid, want_grads: bool):  # fmt: skip
    """``(total, weights, rows, accept, pred, target, d hidden, d markov, d markov_weight)``, unscaled."""
    N, dd, acc = hidden.shape[0], plan.draft_dtype, plan.acc_dtype
    w_head = head_weight.detach().to(dd)
    w2 = markov_weight.detach().to(dd) if markov_weight is not None else None
    if plan.shared_head:
        target_head_weight = head_weight
    tw = target_head_weight.detach().to(plan.target_dtype) if target_head_weight is not None else None
    mix = dict(plan.mix)
    c_ce, c_kl, c_tv = mix.get("ce", 0.0), mix.get("kl_div", 0.0), mix.get("tv", 0.0)
    total = torch.zeros((), dtype=acc, device=hidden.device)
    parts: dict[str, list[torch.Tensor]] = {k: [] for k in ("w", "rows", "accept", "pred", "tgt", "gh", "gu")}
    grad_w2 = None
    if want_grads and w2 is not None:  # accumulated in fp32 at least
        grad_w2 = torch.zeros(
            w2.shape, dtype=torch.promote_types(markov_weight.dtype, torch.float32), device=w2.device
        )
    for s in range(0, N, plan.rows):
        e = min(N, s + plan.rows)
        h = hidden[s:e].detach().to(dd)
        z = F.linear(h, w_head)
        u = None
        if w2 is not None:
            u = markov[s:e].detach().to(dd)
            z = z + F.linear(u, w2)
        z = z.to(acc)
        with torch.no_grad():
            if target_ids is not None:
                t, lp = target_ids[s:e], None
            else:
                raw = F.linear(target_hidden[s:e].detach().to(plan.target_dtype), tw)
                if plan.softcap:
                    raw = torch.tanh(raw / plan.softcap) * plan.softcap
                t = raw.argmax(-1)
                lp = raw.to(acc).log_softmax(-1) if plan.soft else None
        parts["pred"].append(z.argmax(-1))
        parts["tgt"].append(t)
        lq = z.sub_(torch.logsumexp(z, -1, keepdim=True))
        q = lq.exp()
        q_t = q.gather(1, t[:, None]).squeeze(1)
        ce = -lq.gather(1, t[:, None]).squeeze(1)
        p = below = None
        if lp is not None:
            p = lp.exp()
            kl = lp.sub_(lq).mul_(p).sum(-1)  # sum p (log p - log q)
            overlap = torch.minimum(p, q).sum(-1)
            below = q < p  # where min(p, q) = q: TV's gradient flows through these (ties: none in practice)
        else:  # p one-hot at t: KL is the cross-entropy, min(p, q) = q_t
            kl, overlap = ce, q_t
        del lq
        row = c_ce * ce + c_kl * kl + c_tv * (1.0 - overlap)
        v = valid[s:e]
        w = plan.weighting.weights(row.detach(), v).to(acc)
        total = total + (row * w).sum()
        parts["w"].append(w)
        parts["rows"].append(row)
        parts["accept"].append(overlap)
        if not want_grads:
            continue
        # d row / d z = (c_ce + c_kl) q - c_ce e_t - c_kl p + c_tv d TV / d z, where
        # d TV / d z = q * (sum_{q < p} q - [q < p]) (soft) or q_t (q - e_t) (hard)
        onehot = torch.full_like(q_t, -c_ce)
        if below is not None:
            coef = below.to(acc).mul_(-c_tv).add_((c_tv * (q * below).sum(-1) + c_ce + c_kl)[:, None])
            g = q.mul_(coef)
            del coef
            g.sub_(p, alpha=c_kl)
        else:
            g = q.mul_((c_ce + c_kl + c_tv * q_t)[:, None])
            onehot = onehot - c_kl - c_tv * q_t
        g.scatter_add_(1, t[:, None], onehot[:, None])
        g = g.mul_(w[:, None]).to(dd)
        del p, below
        parts["gh"].append((g @ w_head).to(hidden.dtype))
        if u is not None:
            parts["gu"].append((g @ w2).to(markov.dtype))
            grad_w2 += (g.t() @ u).to(grad_w2.dtype)
        del g

    def cat(name):
        return torch.cat(parts[name]) if parts[name] else None

    return (
        total,
        cat("w"),
        cat("rows"),
        cat("accept"),
        cat("pred"),
        cat("tgt"),
        cat("gh"),
        cat("gu"),
        grad_w2,
    )


class _MixLossFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, markov, markov_weight, head_weight, target_hidden, target_head_weight, target_ids,
                valid, plan: _Plan):  # fmt: skip
        with torch.autocast(plan.device_type, enabled=False):
            total, w, rows, accept, pred, tgt, gh, gu, gw2 = _chunks(
                plan, hidden, markov, markov_weight, head_weight, target_hidden, target_head_weight, target_ids,
                valid, want_grads=True,
            )  # fmt: skip
        ctx.w2_dtype = markov_weight.dtype if markov_weight is not None else None
        ctx.save_for_backward(gh, gu, gw2)
        ctx.mark_non_differentiable(w, rows, accept, pred, tgt)
        return total, w.detach(), rows.detach(), accept.detach(), pred, tgt

    @staticmethod
    def backward(ctx, grad_total, *_unused):
        gh, gu, gw2 = ctx.saved_tensors
        grad_h = (gh * grad_total).to(gh.dtype)
        grad_u = None if gu is None else (gu * grad_total).to(gu.dtype)
        grad_w2 = None if gw2 is None else (gw2 * grad_total).to(ctx.w2_dtype)
        return grad_h, grad_u, grad_w2, None, None, None, None, None, None
