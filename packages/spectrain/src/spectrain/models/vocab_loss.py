"""The vocabulary loss of both drafts, chunked over rows so ``[rows, vocabulary]`` never exists whole.

:func:`vocab_loss` has the contract of ``spectrain.models.common.eager_vocab_loss`` (the eager
reference): draft rows ``[N, H]`` and head ``[V, H]``, the verifier's side over the same ``V``
tokens, a mode (``soft``: KL(verifier || draft); ``hard``: cross-entropy on the verifier's
argmax), and returns per-row losses ``[N]``, the draft's argmax ``[N]`` and the verifier's argmax
``[N]``. The verifier's side is either its normed last-layer rows and head rows (its logits are
then formed chunk by chunk) or :class:`VerifierTargets` computed once by :func:`verifier_targets`
(Eagle3's TTT steps read the same verifier rows, shifted, and share them).

Rows are processed ``chunk_rows`` at a time by a custom autograd function. A row's loss depends
on that row alone, so the gradient of row ``r`` is ``grad_output[r]`` times the gradient of
``loss[r]``:

- frozen head (the common case: DFlash's verifier rows, Eagle3 with a frozen ``lm_head``): the
  forward pass computes the gradient w.r.t. the draft rows chunk by chunk and keeps only that
  ``[N, H]`` tensor; backward scales it by ``grad_output``. Three ``N x H x V`` matmuls in all,
  as many as the eager loss (two with precomputed targets);
- trainable head, when the logit gradients fit ``KEEP_BYTES`` (Eagle3's 32k draft vocabulary:
  0.5 GB per TTT step): forward also keeps them, unscaled, in the matmul dtype; backward scales
  them and forms the head gradient. Four matmuls, as eager; memory ``N x V`` in bf16;
- trainable head otherwise: backward recomputes each chunk's logits (and, for ``soft``, the
  verifier's) and accumulates the head gradient in fp32; two matmuls more than eager.

Matmuls run in the autocast dtype when autocast is on (bf16 on the GPU), the softmax math in
fp32. Peak extra memory is about three fp32 ``[chunk_rows, V]`` tensors. Chunk results are
concatenated (no writes into slices), so ``torch.compile`` traces the loss as it is.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

MODES = ("soft", "hard")

CHUNK_BYTES = 256 * 2**20
"""Default size of one fp32 ``[chunk_rows, V]`` tensor (the chunk's peak is about three) off CUDA."""

CUDA_CHUNK_ROWS = 2560
"""Rows per chunk on CUDA (at least; a multiple of 128). The chunk's gradient GEMM ``[rows, V] x
[V, H]`` has ``rows / 128 x H / 128`` output tiles: at H 4096, 2560 rows are 640 tiles, 4.85 waves
of an H200's 132 SMs (97% of the last wave used), where the 384 rows of the 256 MiB budget at
V 151,936 were 96 tiles, under one wave. DFlash's 7,680 rows at the reference shape are then
three chunks. Memory: three fp32 ``[2560, 151936]`` temporaries, 4.3 GiB, against 0.8 GiB
(docs/decisions.md: DFlash's planned peak stays under its 30 GiB target)."""

KEEP_BYTES = 2**30
"""A trainable head keeps its ``[N, V]`` logit gradients (matmul dtype) up to this size, else recomputes."""


def default_chunk_rows(vocab: int, budget_bytes: int | None = None, device_type: str = "cpu") -> int:
    """Rows per chunk: on CUDA at least :data:`CUDA_CHUNK_ROWS` (so its GEMMs fill the GPU), else so
    one fp32 ``[rows, vocab]`` tensor fits ``budget_bytes`` (default :data:`CHUNK_BYTES`; a
    multiple of 64, >= 64)."""
    rows = max(64, (CHUNK_BYTES if budget_bytes is None else budget_bytes) // (4 * max(1, vocab)) // 64 * 64)
    return max(rows, CUDA_CHUNK_ROWS) if device_type == "cuda" else rows


@dataclasses.dataclass
class VerifierTargets:
    """The verifier's side of :func:`vocab_loss` for ``N`` rows, computed once (:func:`verifier_targets`).

    Attributes:
        ids: ``[N]`` the verifier's argmax over the ``V`` rows.
        logits: ``[M, V]`` its logits in the matmul dtype (``soft`` only, else None).
        index: ``[N]`` row of ``logits`` for each of the ``N`` rows (None: row ``r`` is ``r``).
    """

    ids: torch.Tensor
    logits: torch.Tensor | None = None
    index: torch.Tensor | None = None

    def take(self, rows: torch.Tensor) -> VerifierTargets:
        """The targets of ``rows`` (an index into the ``N`` rows; the logits are not copied)."""
        index = None if self.logits is None else (rows if self.index is None else self.index[rows])
        return VerifierTargets(self.ids[rows], self.logits, index)


@torch.no_grad()
def verifier_targets(
    target_hidden: torch.Tensor,
    target_head_weight: torch.Tensor,
    mode: str,
    *,
    chunk_rows: int | None = None,
    softcap: float | None = None,
) -> VerifierTargets:
    """The verifier's argmax (and, for ``soft``, logits) of ``target_hidden [N, H]`` over the rows
    ``target_head_weight [V, H]``; ``hard`` never holds more than one chunk of logits. ``softcap``:
    the verifier's ``final_logit_softcapping`` (the logits become ``cap * tanh(logits / cap)``)."""
    _check_mode(mode)
    device_type = target_hidden.device.type
    td = (
        torch.get_autocast_dtype(device_type)
        if torch.is_autocast_enabled(device_type)
        else target_head_weight.dtype
    )
    rows = chunk_rows or default_chunk_rows(target_head_weight.shape[0], device_type=device_type)
    with torch.autocast(device_type, enabled=False):
        tw = target_head_weight.to(td)
        if mode == "soft":
            logits = _softcap(F.linear(target_hidden.to(td), tw), softcap)
            return VerifierTargets(logits.argmax(-1), logits)
        ids = [F.linear(target_hidden[s : s + rows].to(td), tw).argmax(-1)
               for s in range(0, target_hidden.shape[0], rows)]  # fmt: skip
    return VerifierTargets(torch.cat(ids))


def _softcap(logits: torch.Tensor, cap: float | None) -> torch.Tensor:
    """``cap * tanh(logits / cap)``, as the verifier's own forward (monotonic: argmaxes unchanged)."""
    return logits if not cap else torch.tanh(logits / cap) * cap


def _check_mode(mode: str) -> None:
    if mode not in MODES:
        raise ValueError(f"unknown target_mode {mode!r} (soft | hard)")


def vocab_loss(
    hidden: torch.Tensor,
    head_weight: torch.Tensor,
    target_hidden: torch.Tensor | None = None,
    target_head_weight: torch.Tensor | None = None,
    mode: str = "hard",
    *,
    targets: VerifierTargets | None = None,
    chunk_rows: int | None = None,
    keep_logit_grads: bool | None = None,
    target_softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-row loss between the draft's and the verifier's distributions over ``V`` tokens.

    Args:
        hidden: ``[N, H]`` the draft's final (normed) states; gradients flow to it.
        head_weight: ``[V, H]`` the draft's output rows; gets a gradient when it requires one.
        target_hidden: ``[N, H]`` the verifier's last-layer states after its final norm.
        target_head_weight: ``[V, H]`` the verifier's LM-head rows of the same ``V`` tokens.
        mode: ``soft`` (KL(verifier || draft)) or ``hard`` (cross-entropy on the verifier's argmax).
        targets: the verifier's side computed beforehand (:func:`verifier_targets`), in place of
            ``target_hidden`` and ``target_head_weight``.
        chunk_rows: rows per chunk (default :func:`default_chunk_rows` of ``V`` on this device).
        keep_logit_grads: trainable head only: keep the ``[N, V]`` logit gradients from forward
            (True) or recompute them in backward (False); None: keep when they fit ``KEEP_BYTES``.
        target_softcap: the verifier's ``final_logit_softcapping`` applied to its logits formed
            here from ``target_hidden`` (precomputed ``targets`` carry it already).

    Returns:
        ``(loss [N] float32, draft argmax [N], verifier argmax [N])``; argmaxes index the ``V`` rows.
    """
    _check_mode(mode)
    soft = mode == "soft"
    if targets is None:
        if target_hidden is None or target_head_weight is None:
            raise ValueError("vocab_loss needs targets or both target_hidden and target_head_weight")
        if hidden.dim() != 2 or target_hidden.shape != hidden.shape:
            raise ValueError(f"hidden {tuple(hidden.shape)} and target_hidden {tuple(target_hidden.shape)} "
                             "must both be [N, H]")  # fmt: skip
        if head_weight.dim() != 2 or head_weight.shape != target_head_weight.shape:
            raise ValueError(f"head_weight {tuple(head_weight.shape)} and target_head_weight "
                             f"{tuple(target_head_weight.shape)} must both be [V, H]")  # fmt: skip
        ids = logits = index = None
    else:
        ids, logits, index = targets.ids, targets.logits, targets.index
        if hidden.dim() != 2 or ids.shape != hidden.shape[:1]:
            raise ValueError(f"hidden {tuple(hidden.shape)} must be [N, H] with targets for its N rows, "
                             f"got {tuple(ids.shape)}")  # fmt: skip
        if soft and (logits is None or logits.shape[1] != head_weight.shape[0]):
            raise ValueError("soft targets need the verifier's logits over the head's V rows")
        target_hidden = target_head_weight = None
    if head_weight.shape[1] != hidden.shape[1]:
        raise ValueError(f"head_weight is [V, {head_weight.shape[1]}], hidden is [N, {hidden.shape[1]}]")
    rows = chunk_rows or default_chunk_rows(head_weight.shape[0], device_type=hidden.device.type)
    if rows < 1:
        raise ValueError(f"chunk_rows must be >= 1, got {rows}")
    plan = _Plan.of(hidden, target_head_weight, soft, rows)
    if keep_logit_grads is None:
        size = torch.finfo(plan.draft_dtype).bits // 8
        keep_logit_grads = hidden.shape[0] * head_weight.shape[0] * size <= KEEP_BYTES
    plan.keep = keep_logit_grads
    plan.target_softcap = target_softcap
    # one tensor may enter an autograd function (and torch.compile) once
    if target_head_weight is head_weight:
        plan.shared_head, target_head_weight = True, None
    side = (target_hidden, target_head_weight, ids, logits, index)
    needs_grad = torch.is_grad_enabled() and (hidden.requires_grad or head_weight.requires_grad)
    if not needs_grad:
        with torch.autocast(plan.device_type, enabled=False):
            loss, pred, tgt, _, _, _, _ = _forward_chunks(
                plan, hidden, head_weight, _shared(plan, side, head_weight)
            )
        return loss, pred, tgt
    return _ChunkedVocabLoss.apply(hidden, head_weight, *side, plan)


@dataclasses.dataclass
class _Plan:
    """Dtypes and chunking of one call (fixed before the autograd function runs)."""

    device_type: str
    draft_dtype: torch.dtype
    target_dtype: torch.dtype
    acc_dtype: torch.dtype
    soft: bool
    rows: int
    keep: bool = False
    target_softcap: float | None = None
    shared_head: bool = False
    """The verifier's head rows are the draft's (``target_head_weight is head_weight``)."""

    @classmethod
    def of(cls, hidden, target_head_weight, soft: bool, rows: int) -> _Plan:
        device_type = hidden.device.type
        if torch.is_autocast_enabled(device_type):
            # the eager loss runs both heads as autocast linears: in the autocast dtype
            dd = td = torch.get_autocast_dtype(device_type)
        else:
            dd = hidden.dtype
            td = target_head_weight.dtype if target_head_weight is not None else dd
        return cls(device_type, dd, td, torch.promote_types(dd, torch.float32), soft, rows)


def _shared(plan: _Plan, side: tuple, head_weight: torch.Tensor) -> tuple:
    """``side`` with the draft's head as the verifier's when they are one tensor."""
    return (side[0], head_weight, *side[2:]) if plan.shared_head else side


def _chunk_targets(plan: _Plan, s: int, e: int, side) -> tuple[torch.Tensor | None, torch.Tensor]:
    """The verifier's fp32 logits of rows ``s:e`` (``soft``; None for ``hard``) and their argmax."""
    th, tw, ids, logits, index = side
    with torch.no_grad():
        if th is None:  # computed beforehand (verifier_targets)
            if not plan.soft:
                return None, ids[s:e]
            rows = logits[s:e] if index is None else logits[index[s:e]]
            return rows.to(plan.acc_dtype, copy=True), ids[s:e]  # a copy: the caller works in place
        raw = F.linear(th[s:e].detach().to(plan.target_dtype), tw.detach().to(plan.target_dtype))
        raw = _softcap(raw, plan.target_softcap)
        return (raw.to(plan.acc_dtype) if plan.soft else None), raw.argmax(-1)


def _forward_chunks(plan: _Plan, hidden, head_weight, side, want_grad_hidden=False, keep_lse=False,
                    want_logit_grads=False):  # fmt: skip
    """Loss, argmaxes and (when asked) d loss[r] / d hidden[r] and d loss[r] / d logits[r], chunk
    by chunk.

    Returns ``(loss, draft argmax, verifier argmax, draft lse or None, verifier lse or None,
    d hidden or None, d logits or None)``.
    """
    N = hidden.shape[0]
    w = head_weight.detach().to(plan.draft_dtype)
    loss, pred, tgt, lse_d, lse_t, grad_h, logit_g = [], [], [], [], [], [], []
    for s in range(0, N, plan.rows):
        e = min(N, s + plan.rows)
        ld = F.linear(hidden[s:e].detach().to(plan.draft_dtype), w).to(plan.acc_dtype)
        lt, t = _chunk_targets(plan, s, e, side)
        pred.append(ld.argmax(-1))
        tgt.append(t)
        lse = torch.logsumexp(ld, -1)
        p = None
        if plan.soft:
            tl = torch.logsumexp(lt, -1)
            logp = lt.sub_(tl[:, None])
            p = logp.exp()
            # KL(p || q) = sum p * (log p - ld) + lse(ld) (sum p = 1), in place of log p
            loss.append(logp.sub_(ld).mul_(p).sum(-1) + lse)
            del logp, lt
            if keep_lse:
                lse_t.append(tl)
        else:
            loss.append(lse - ld.gather(1, t[:, None]).squeeze(1))
        if keep_lse:
            lse_d.append(lse)
        if want_grad_hidden or want_logit_grads:
            g = _logit_grad(ld, lse, p, t).to(plan.draft_dtype)
            if want_grad_hidden:
                grad_h.append((g @ w).to(hidden.dtype))
            if want_logit_grads:
                logit_g.append(g)
            del g
        del ld, p

    def cat(parts):
        return torch.cat(parts) if parts else None

    return cat(loss), cat(pred), cat(tgt), cat(lse_d), cat(lse_t), cat(grad_h), cat(logit_g)


def _logit_grad(
    ld: torch.Tensor, lse: torch.Tensor, p: torch.Tensor | None, tgt: torch.Tensor
) -> torch.Tensor:
    """``softmax(ld) - target`` (in place of ``ld``): d loss[r] / d logits[r]."""
    g = ld.sub_(lse[:, None]).exp_()
    if p is not None:
        return g.sub_(p)
    return g.scatter_add_(1, tgt[:, None], torch.full_like(lse[:, None], -1.0))


class _ChunkedVocabLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, head_weight, target_hidden, target_head_weight, ids, logits, index, plan: _Plan):
        side = _shared(plan, (target_hidden, target_head_weight, ids, logits, index), head_weight)
        train_head = head_weight.requires_grad
        keep = train_head and plan.keep
        with torch.autocast(plan.device_type, enabled=False):
            loss, pred, tgt, lse_d, lse_t, grad_hidden, logit_grads = _forward_chunks(
                plan,
                hidden,
                head_weight,
                side,
                want_grad_hidden=(keep or not train_head) and hidden.requires_grad,
                keep_lse=train_head and not keep,
                want_logit_grads=keep,
            )
        ctx.plan = plan
        ctx.head_dtype = head_weight.dtype
        ctx.mode = "recompute" if train_head and not keep else ("keep" if keep else "frozen")
        if ctx.mode == "keep":
            ctx.save_for_backward(grad_hidden, logit_grads, hidden)
        elif ctx.mode == "recompute":
            soft = plan.soft
            ctx.save_for_backward(hidden, head_weight, target_hidden if soft else None,
                                  target_head_weight if soft and not plan.shared_head else None,
                                  logits if soft else None,
                                  index if soft else None, lse_d, lse_t, tgt)  # fmt: skip
        else:
            ctx.save_for_backward(grad_hidden)
        ctx.mark_non_differentiable(pred, tgt)
        return loss, pred, tgt

    @staticmethod
    def backward(ctx, grad_loss, _grad_pred, _grad_tgt):
        plan: _Plan = ctx.plan
        none = (None,) * 6
        if ctx.mode == "frozen":
            (grad_hidden,) = ctx.saved_tensors
            if grad_hidden is None:
                return None, None, *none
            return (grad_hidden * grad_loss[:, None]).to(grad_hidden.dtype), None, *none
        if ctx.mode == "keep":
            grad_hidden, logit_grads, hidden = ctx.saved_tensors
            grad_h = None if grad_hidden is None else (grad_hidden * grad_loss[:, None]).to(grad_hidden.dtype)
            with torch.autocast(plan.device_type, enabled=False):
                grad_w = _head_grad(plan, grad_loss, logit_grads, hidden)
            return grad_h, grad_w.to(ctx.head_dtype), *none
        hidden, head_weight, th, tw, logits, index, lse_d, lse_t, tgt = ctx.saved_tensors
        with torch.autocast(plan.device_type, enabled=False):
            side = _shared(plan, (th, tw, tgt, logits, index), head_weight)
            grad_h, grad_w = _backward_chunks(plan, grad_loss, hidden, head_weight, side, lse_d, lse_t,
                                              ctx.needs_input_grad[0])  # fmt: skip
        return grad_h, grad_w, *none


def _head_grad(plan: _Plan, grad_loss, logit_grads, hidden) -> torch.Tensor:
    """``sum_r grad_loss[r] * logit_grads[r]^T hidden[r]`` chunk by chunk, accumulated in fp32."""
    go = grad_loss.to(plan.acc_dtype)
    grad_w = torch.zeros(logit_grads.shape[1], hidden.shape[1], dtype=torch.float32, device=hidden.device)
    for s in range(0, hidden.shape[0], plan.rows):
        e = min(hidden.shape[0], s + plan.rows)
        g = (logit_grads[s:e] * go[s:e, None]).to(plan.draft_dtype)
        grad_w += (g.t() @ hidden[s:e].detach().to(plan.draft_dtype)).float()
    return grad_w


def _backward_chunks(plan, grad_loss, hidden, head_weight, side, lse_d, lse_t, want_hidden):
    """Recompute each chunk's logit gradient; return (d hidden or None, d head_weight)."""
    w = head_weight.detach().to(plan.draft_dtype)
    tgt = side[2]
    grad_w = torch.zeros(head_weight.shape, dtype=torch.float32, device=head_weight.device)
    grad_h = []
    go = grad_loss.to(plan.acc_dtype)
    for s in range(0, hidden.shape[0], plan.rows):
        e = min(hidden.shape[0], s + plan.rows)
        h = hidden[s:e].detach().to(plan.draft_dtype)
        ld = F.linear(h, w).to(plan.acc_dtype)
        p = None
        if plan.soft:
            lt, _ = _chunk_targets(plan, s, e, side)
            p = lt.sub_(lse_t[s:e, None]).exp_()
        g = _logit_grad(ld, lse_d[s:e], p, tgt[s:e]).mul_(go[s:e, None]).to(plan.draft_dtype)
        del ld, p
        if want_hidden:
            grad_h.append((g @ w).to(hidden.dtype))
        grad_w += (g.t() @ h).float()
    return (torch.cat(grad_h) if want_hidden else None), grad_w.to(head_weight.dtype)
