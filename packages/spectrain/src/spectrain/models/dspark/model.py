"""The DSpark draft and its options: DFlash's block forward, a Markov head correcting each slot's
logits from the previous token, a confidence head, and the mixed distribution-matching loss.

Training reuses DFlash's anchors (drawn into a fixed buffer), block mask, context features and
draft layers unchanged; every slot's previous token is the true one (teacher forcing). Decoding
(:meth:`DSparkDraft.propose`) runs one block forward, then corrects the slots left to right as
vLLM's DSpark proposer does: previous token = the anchor, then each proposed token.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from spectrain.data.batch import Batch
from spectrain.models.common import chain_metrics, greedy_reach, stored_target_ids
from spectrain.models.dflash import DFlashConfig, DFlashDraft
from spectrain.models.dspark.heads import ConfidenceHead, MarkovHead
from spectrain.models.dspark.loss import MixLoss, SlotWeighting, mix_loss, parse_loss_mix
from spectrain.models.registry import DraftContext, DraftModel, register
from spectrain.models.served_config import speculators_config
from spectrain.models.verifier import VerifierHeads
from spectrain.models.vocab_loss import verifier_targets

MARKOV_HEADS = ("vanilla", "gated", "rnn")


@register("dspark")
@dataclass
class DSparkConfig(DFlashConfig):
    """DSpark options (DFlash's are documented on :class:`~spectrain.models.dflash.DFlashConfig`).

    The defaults are speculators 0.9.0's for ``--speculator-type dspark`` (block 8, anchor-first,
    rank-256 vanilla Markov head, confidence head on its features) except where speculators is
    wrong (a slot trains where the token it predicts is trained, ``slot_mask``, and an anchor is
    drawn only where its first label is, ``anchor_needs_label``) and its loss: ours is our DFlash's,
    cross-entropy on the verifier's argmax weighted by D-PACE, where speculators' is KL over the
    verifier's distribution with fixed ``exp(-j / gamma)`` weights (measured: docs/decisions.md).
    """

    block_size: int = 8
    sample_from_anchor: bool = True
    """``True`` (anchor-first): every slot of the block predicts, slot ``k`` the token ``k + 1``
    after the anchor, so a block proposes ``block_size`` tokens. ``False``: DFlash's fill-in
    layout (the anchor is given, ``block_size - 1`` tokens)."""
    markov_rank: int = 256
    """Rank of the Markov head's bias ``W2(W1[prev])`` on each slot's logits (0: no Markov head)."""
    markov_head_type: str = "vanilla"
    """``vanilla`` (``W2 e``), ``gated`` (``W2(sigmoid(G[h; e]) * e)``) or ``rnn`` (a gated state
    carried over the block's slots). vLLM 0.32 serves only ``vanilla``."""
    enable_confidence_head: bool = True
    """A per-slot logit predicting the slot's acceptance, trained with BCE on the detached
    ``1 - TV(draft, verifier)``."""
    confidence_head_with_markov: bool = True
    """The confidence head reads ``[h; W1[prev]]`` (needs ``markov_rank > 0``), else ``h``."""
    confidence_head_alpha: float = 1.0
    """Weight of the confidence BCE in the loss."""
    loss_mix: dict[str, float] = field(default_factory=lambda: {"kl_div": 1.0})
    """Weighted terms of the distribution-matching loss (speculators' ``--loss-fn``): ``ce``,
    ``kl_div``, ``tv``. DeepSpec's ``0.1 CE + 0.9 L1`` is ``{"ce": 0.1, "tv": 1.8}`` (TV is half
    the L1 distance)."""
    target_mode: str = "hard"
    """``hard``: the terms compare with the verifier's argmax as a one-hot distribution (then
    ``kl_div`` is the cross-entropy and ``tv`` is ``1 - q(argmax)``; a store of target ids only
    trains this way); ``soft``: with its distribution (speculators)."""
    loss_weighting: str = "dpace"
    """``exp-decay``: the ``j``-th predicting slot weighs ``exp(-j / gamma)``; ``dpace``: D-PACE from
    the draft's own per-slot loss (the confidence BCE keeps the fixed decay, as speculators)."""
    slot_mask: str = "label"
    """A slot trains where the token it predicts has loss mask 1 (``label``), or, anchor-first, where
    its own input token has (``input``: speculators 0.9.0, its PR #865)."""
    anchor_needs_label: bool = True
    """Draw an anchor only where its first slot trains (DeepSpec's ``mask[a] and mask[a + 1]``);
    False: any trained slot, as speculators."""

    default_optimizer: ClassVar[str] = "muon"

    def check(self) -> None:
        super().check()
        self.choose("markov_head_type", MARKOV_HEADS)
        self.choose("slot_mask", ("label", "input"))
        self.loss_mix = parse_loss_mix(self.loss_mix)
        if self.markov_rank < 0:
            raise ValueError(f"markov_rank: must be >= 0, got {self.markov_rank}")
        if self.enable_confidence_head and self.confidence_head_with_markov and self.markov_rank == 0:
            raise ValueError("confidence_head_with_markov: needs markov_rank > 0 (or set it false)")
        if self.confidence_head_alpha < 0:
            raise ValueError(f"confidence_head_alpha: must be >= 0, got {self.confidence_head_alpha}")

    @property
    def proposals(self) -> int:
        """Tokens one block proposes: ``block_size`` anchor-first, ``block_size - 1`` fill-in."""
        return self.block_size if self.sample_from_anchor else self.block_size - 1

    @staticmethod
    def model_class() -> type[DraftModel]:
        return DSparkDraft


class DSparkDraft(DFlashDraft):
    """DSpark. Module names are speculators' and vLLM's: DFlash's plus ``markov_head.*`` and
    ``confidence_head.proj``. Slot ``k`` of a block at anchor ``a`` predicts the token at
    ``a + k + 1`` (anchor-first) or ``a + k`` (fill-in, slots ``1..B-1``)."""

    config_class = DSparkConfig

    def __init__(self, cfg: DSparkConfig, verifier: VerifierHeads):
        super().__init__(cfg, verifier)
        self.offset = 0 if cfg.sample_from_anchor else 1
        """Index of the first predicting slot."""
        draft_vocab = cfg.draft_vocab_size if self.reduced else verifier.vocab_size
        self.markov_head = (
            MarkovHead(cfg.markov_head_type, verifier.vocab_size, draft_vocab, cfg.markov_rank, self.hidden)
            if cfg.markov_rank
            else None
        )
        self.confidence_head = None
        if cfg.enable_confidence_head:
            with_markov = cfg.confidence_head_with_markov
            self.confidence_head = ConfidenceHead(
                self.hidden + (cfg.markov_rank if with_markov else 0), with_markov
            )
        self.reset_heads()

    def reset_heads(self, std: float = 0.02) -> None:
        """Initialise the Markov head (:meth:`MarkovHead.reset_parameters`) and the confidence head."""
        if self.markov_head is not None:
            self.markov_head.reset_parameters(std)
        if self.confidence_head is not None:
            nn.init.normal_(self.confidence_head.proj.weight, std=std)
            nn.init.zeros_(self.confidence_head.proj.bias)

    @property
    def max_proposals(self) -> int:
        """Tokens one block proposes: ``block_size`` anchor-first, ``block_size - 1`` fill-in."""
        return self.cfg.proposals

    # ------------------------------------------------------------------ training

    def anchor_candidates(self, batch: Batch) -> torch.Tensor:
        """DFlash's rule with room for the block's last label and, with ``anchor_needs_label``, a
        trained first slot (speculators draws any trained slot but the last ``block_size``)."""
        cfg: DSparkConfig = self.cfg
        S, B = batch.seq_len, cfg.block_size
        slots = torch.arange(S, device=batch.input_ids.device)
        trained = self.trained_slots(batch)
        if cfg.anchor_rule == "packed":
            cand = trained & (slots + B < S)
        else:
            last = slots + B - self.offset  # the block's last label
            cand = trained & (batch.doc_ids >= 0) & (last < batch.doc_ends) & (batch.position_ids >= 1)
        if cfg.anchor_needs_label:
            cand = cand & trained[self._gate_slots(slots + 1).clamp(max=S - 1)]
        return cand

    def greedy_agree(self, batch: Batch) -> torch.Tensor:
        """``[S]`` bool: the token after each slot is the verifier's greedy choice there (its stored
        target id, or the argmax of its head over the last layer), inside one document."""
        S = batch.seq_len
        nxt = torch.arange(1, S + 1, device=batch.input_ids.device).clamp(max=S - 1)
        if batch.target_ids is not None:
            greedy = batch.target_ids
        else:
            with torch.no_grad():
                greedy = verifier_targets(self.verifier.norm(batch.last_hidden), self.verifier.lm_head, "hard",
                                          softcap=self.verifier.softcap).ids  # fmt: skip
        same_doc = (batch.doc_ids[nxt] == batch.doc_ids) & (batch.doc_ids >= 0)
        return same_doc & (batch.input_ids[nxt] == greedy)

    def _gate_slots(self, labels: torch.Tensor) -> torch.Tensor:
        """The slot whose loss mask gates a slot predicting ``labels``: the label itself, or (anchor-first
        with ``slot_mask`` ``input``, speculators 0.9.0) the slot's own input token, one before."""
        if self.cfg.sample_from_anchor and self.cfg.slot_mask == "input":
            return labels - 1
        return labels

    def block_slots(
        self, batch: Batch, anchors: torch.Tensor, anchor_valid: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(labels [N, K], valid [N, K], prev_ids [N, B])``: the slot each predicting slot's token
        sits at, whether it trains, and every slot's previous token (teacher forcing; a fill-in
        block's anchor slot gets the anchor)."""
        S, B, off = batch.seq_len, self.cfg.block_size, self.offset
        k = torch.arange(B, device=anchors.device)
        labels_all = anchors[:, None] + k[None, :] + (1 - off)
        prev = torch.maximum(labels_all - 1, anchors[:, None]).clamp(max=S - 1)
        labels = labels_all[:, off:].clamp(max=S - 1)
        inside = labels_all[:, off:] < S
        if self.cfg.train_region == "greedy":
            same = batch.doc_ids[labels] == batch.doc_ids[anchors][:, None]
            valid = same & inside & anchor_valid[:, None]
        else:
            gate = batch.loss_mask.bool()[self._gate_slots(labels).clamp(max=S - 1)]
            valid = gate & inside & anchor_valid[:, None]
        return labels, valid, batch.input_ids[prev]

    def block_outputs(self, batch: Batch, anchors: torch.Tensor, anchor_valid: torch.Tensor, mask=None):
        """Slot states ``h [N, K, H]``, Markov features ``u`` and ``W1[prev]`` ``[N, K, r]`` (None
        without a Markov head), ``labels [N, K]`` and ``valid [N, K]``."""
        if mask is None:
            mask = self._prepared_mask(batch, anchors, anchor_valid)
        ctx = self.context_features(batch.aux_hidden)
        out = self._run_blocks(ctx, batch.position_ids, batch.input_ids[anchors], batch.position_ids[anchors],
                               mask, batch.input_ids.device)  # fmt: skip
        labels, valid, prev_ids = self.block_slots(batch, anchors, anchor_valid)
        off = self.offset
        u = emb = None
        if self.markov_head is not None:
            u, emb = self.markov_head.block_features(prev_ids, out)
            u, emb = u[:, off:], emb[:, off:]
        return out[:, off:], u, emb, labels, valid

    def slot_weighting(self) -> SlotWeighting:
        cfg: DSparkConfig = self.cfg
        return SlotWeighting(cfg.proposals, cfg.loss_weighting, self.gamma, cfg.dpace_alpha)

    def vocabulary_loss(self, batch: Batch, h, u, labels, valid) -> tuple[MixLoss, torch.Tensor]:
        """:func:`~spectrain.models.dspark.loss.mix_loss` of the slots and the rows that train
        (``valid`` less the slots whose stored target the draft vocabulary lacks)."""
        cfg: DSparkConfig = self.cfg
        N, K = labels.shape
        head = self._head_rows()
        kw: dict[str, Any] = dict(mix=cfg.loss_mix, weighting=self.slot_weighting(), mode=cfg.target_mode,
                                  target_softcap=self.verifier.softcap)  # fmt: skip
        if u is not None:
            kw.update(markov=u.reshape(N * K, -1), markov_weight=self.markov_head.markov_w2.weight)
        if batch.target_ids is not None:  # a store of target ids: the verifier's argmax, stored
            if cfg.target_mode != "hard":
                raise ValueError(
                    "soft targets need the verifier's final layer; this batch has target ids only"
                )
            ids, known = stored_target_ids(batch.target_ids[labels - 1].reshape(-1), self._draft_ids(),
                                           self.verifier.vocab_size)  # fmt: skip
            valid = valid & known.view(N, K)
            kw["target_ids"] = ids
        else:
            kw["target_hidden"] = self.verifier.norm(batch.last_hidden[labels - 1].reshape(N * K, -1))
            kw["target_head_weight"] = head
        return mix_loss(h.reshape(N * K, -1), head, valid.reshape(-1), **kw), valid

    def training_loss(
        self, batch: Batch, draws
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor], dict[str, Any]]:
        """The mixed loss (normalised by ``loss_norm``) plus ``confidence_head_alpha`` x the
        confidence BCE (fixed slot decay, over the trained slots), and metric sums."""
        cfg: DSparkConfig = self.cfg
        anchors, anchor_valid, mask = draws
        h, u, emb, labels, valid = self.block_outputs(batch, anchors, anchor_valid, mask)
        N, K = labels.shape
        if cfg.train_region == "greedy":
            valid = valid & greedy_reach(self.greedy_agree(batch)[labels - 1])
        res, valid = self.vocabulary_loss(batch, h, u, labels, valid)
        acc = res.total.dtype
        count = valid.sum().to(acc)
        weight_sum = count if cfg.loss_norm == "count" else res.weights.sum()
        denom = count + 1e-5 if cfg.loss_norm == "count" else weight_sum.clamp_min(1e-6)
        loss = res.total / denom
        accept = res.accept.view(N, K)
        vf = valid.to(acc)
        metrics = chain_metrics((res.pred == res.target).view(N, K), valid)
        metrics["loss_sum"] = res.total.detach().double()
        metrics["weight_sum"] = weight_sum.detach().double()
        metrics["accept_rate_sum"] = (accept * vf).sum().double()
        metrics["accept_rate_total"] = count.double()
        chains = valid[:, 0].to(acc)
        metrics["expected_tau_sum"] = (
            ((1.0 + torch.cumprod(accept * vf, dim=1).sum(1)) * chains).sum().double()
        )
        metrics["expected_tau_total"] = chains.sum().double()
        if self.confidence_head is not None:
            logits = self.confidence_head(h, emb)
            bce = F.binary_cross_entropy_with_logits(logits, accept.to(logits.dtype), reduction="none")
            decay = self.slot_weighting().decay(bce.dtype, bce.device)
            conf_sum = (bce * decay[None, :] * valid.to(bce.dtype)).sum()
            loss = loss + cfg.confidence_head_alpha * conf_sum / (count.to(bce.dtype) + 1e-8)
            with torch.no_grad():
                err = (torch.sigmoid(logits.detach().float()) - accept.float()).abs() * vf.float()
            metrics["confidence_loss_sum"] = conf_sum.detach().double()
            metrics["confidence_loss_total"] = count.double()
            metrics["confidence_error_sum"] = err.sum().double()
            metrics["confidence_error_total"] = count.double()
        pred = res.pred
        draft_ids = self._draft_ids()
        if draft_ids is not None:
            pred = draft_ids[pred]
        outputs = {"anchors": anchors, "anchor_valid": anchor_valid, "predictions": pred.view(N, K),
                   "accept": accept.detach(), "flops": self._flops(batch, anchors, anchor_valid)}  # fmt: skip
        return loss, metrics, outputs

    def _flops(self, batch: Batch, anchors: torch.Tensor, anchor_valid: torch.Tensor) -> torch.Tensor:
        """DFlash's count with ``K`` vocabulary rows per block, plus the heads (forward + backward)."""
        flops = super()._flops(batch, anchors, anchor_valid)
        B, K, H = self.cfg.block_size, self.cfg.proposals, self.hidden
        V = self.cfg.draft_vocab_size if self.reduced else self.verifier.vocab_size
        n = anchor_valid.sum().double()
        flops = flops + 2 * n * (K - (B - 1)) * H * V * 3
        if self.markov_head is not None:
            flops = flops + 2 * n * K * self.cfg.markov_rank * V * 3 + self.markov_head.flops(n * B, H, V)
        if self.confidence_head is not None:
            flops = flops + 2 * n * K * self.confidence_head.proj.in_features * 3
        if self.cfg.train_region == "greedy" and batch.target_ids is None:
            flops = flops + 2 * batch.seq_len * H * self.verifier.vocab_size  # the verifier's argmax
        return flops

    # ------------------------------------------------------------------ decoding

    @torch.no_grad()
    def propose(
        self, context: DraftContext, num_tokens: int | None = None, step_tokens: int | None = None
    ) -> list[int]:
        """One block forward, then the sequential Markov correction, greedy.

        Args:
            context: as :meth:`DFlashDraft.propose` (the last token id is the anchor).
            num_tokens: tokens to return (default: all the block proposes).
            step_tokens: the step's proposal count the block is sized for (vLLM runs ``K`` query
                slots anchor-first, ``1 + K`` fill-in, for ``num_speculative_tokens = K``); default
                ``num_tokens``. The first ``num_tokens`` of those are returned.

        Slot ``i``'s logits get ``markov_w2(u_i)``, ``u_i`` from the previous token: the anchor for
        the first, then each proposed token (verifier ids), as vLLM's ``DSparkSpeculator``.
        """
        K = self.max_proposals
        n = K if num_tokens is None else num_tokens
        step = max(n, step_tokens or n)
        if not 0 < n <= step <= K:
            raise ValueError(f"DSpark proposes 1..{K} tokens per block, asked for {n} of {step}")
        off = self.offset
        out = self.propose_block(context, step + off)
        h = out[off : off + n]
        base = F.linear(h, self._head_rows().to(h.dtype))
        draft_ids = self._draft_ids()
        prev = torch.as_tensor(context.token_ids, dtype=torch.int64, device=h.device)[-1:]
        head, state, picked = self.markov_head, None, []
        if (
            head is not None and head.kind == "rnn" and off
        ):  # the anchor slot advances the state, as in training
            _, state = head.step(head.embed(prev), out[:1], None)
        for i in range(n):
            logits = base[i : i + 1]
            if head is not None:
                u, state = head.step(head.embed(prev), h[i : i + 1], state)
                logits = logits + head.bias(u).to(logits.dtype)
            tok = logits.argmax(-1)
            prev = draft_ids[tok] if draft_ids is not None else tok
            picked.append(prev)
        return [int(t) for t in torch.cat(picked).tolist()]

    # ------------------------------------------------------------------ export

    def vllm_refusal(self) -> str | None:
        """Why vLLM 0.32 cannot serve this draft as trained (None: it can)."""
        cfg: DSparkConfig = self.cfg
        if cfg.markov_head_type != "vanilla":
            return (f"markov_head_type {cfg.markov_head_type}: vLLM 0.32 serves only the vanilla Markov head (its "
                    "DSpark model has no module for the other weights); train with markov_head_type=vanilla")  # fmt: skip
        if cfg.markov_rank == 0:
            return ("markov_rank 0: vLLM 0.32's DSpark model always builds a Markov head; a draft without one is "
                    "served as DFlash (--speculator-type dflash)")  # fmt: skip
        if cfg.sliding_window is None and cfg.block_attention == "causal":
            return ("block_attention causal on full-attention layers: vLLM 0.32 serves full-attention DSpark layers "
                    "bidirectionally; train with block_attention=bidirectional")  # fmt: skip
        if cfg.sliding_window is not None and cfg.block_attention == "bidirectional":
            return ("block_attention bidirectional with a sliding window: vLLM 0.32 serves sliding-window DSpark "
                    "layers causally; train with block_attention=causal")  # fmt: skip
        return None

    def vllm_config(self, verifier_name: str, architectures: Sequence[str]) -> dict[str, Any]:
        """DFlash's fields with DSpark's, each written explicitly (vLLM's defaults for the absent
        ones differ from speculators': ``sample_from_anchor`` and the confidence flags false)."""
        cfg: DSparkConfig = self.cfg
        out = super().vllm_config(verifier_name, architectures)
        out.update(
            architectures=["DSparkDraftModel"],  # speculators' name; vLLM serves it as Qwen3DSparkModel
            speculators_model_type="dspark",
            speculators_config=speculators_config("dspark", cfg.proposals, verifier_name, architectures),
            block_size=cfg.block_size,
            sample_from_anchor=cfg.sample_from_anchor,
            markov_rank=cfg.markov_rank,
            markov_head_type=cfg.markov_head_type,
            enable_confidence_head=cfg.enable_confidence_head,
            confidence_head_with_markov=cfg.enable_confidence_head and cfg.confidence_head_with_markov,
        )
        return out
