"""DFlash: a block-diffusion draft that proposes ``block_size - 1`` tokens in one forward pass.

The verifier's auxiliary-layer states are concatenated, projected by ``fc`` and normed by
``hidden_norm``; the result is injected as extra keys/values into every draft layer. The
draft's own input is a block ``[anchor token, MASK x (B-1)]``; inside the block attention is
bidirectional, and the block sees the verifier context strictly before the anchor (same
document). Position ``k`` of the block predicts the token ``k`` places after the anchor.

Training draws up to ``max_anchors`` random anchors per packed sequence where the loss mask
is 1 (``anchor_rule``: the whole block inside the anchor's document, or anywhere but the last
``block_size`` slots of the packed sequence, as speculators does), and weights position ``k``
by ``exp(-(k - 1) / gamma)`` or by D-PACE (``loss_weighting``). Embeddings and LM head are the
verifier's, frozen. Module names equal vLLM's ``DFlashDraftModel`` weight names.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from spectrain.data.batch import Batch
from spectrain.models.common import (
    build_vocab_map,
    chain_metrics,
    default_dflash_gamma,
    dpace_weights,
    draft_to_target_ids,
    greedy_reach,
    loss_decay_weights,
    stored_target_ids,
)
from spectrain.models.layers import (
    MLP,
    MaskSpec,
    PreparedMask,
    RMSNorm,
    apply_rope,
    context_bucket,
    rope_cos_sin,
)
from spectrain.models.registry import DraftConfig, DraftContext, DraftModel, register
from spectrain.models.served_config import qwen3_layer_config, speculators_config
from spectrain.models.verifier import VerifierHeads
from spectrain.models.vocab_loss import VerifierTargets, vocab_loss


@register("dflash")
@dataclass
class DFlashConfig(DraftConfig):
    """DFlash options (the shared ones are documented on :class:`DraftConfig`)."""

    num_layers: int = 5
    block_size: int = 16
    """Tokens per block: the anchor plus ``block_size - 1`` proposed tokens."""
    max_anchors: int = 512
    """Most anchors drawn per packed sequence (bounds the attention mask)."""
    mask_token_id: int | None = None
    """Token id whose (frozen) embedding fills the masked block slots; None = verifier vocab_size - 1."""
    loss_gamma: float | None = None
    """Decay of the ``exp-decay`` weight; None = 7 / 5 / 4 for block size 16 / 10 / 8."""
    target_mode: str = "hard"
    loss_norm: str = "count"
    loss_weighting: str = "dpace"
    """Per-position loss weight: ``dpace`` (the expected accepted length each position gates,
    from the draft's own confidence) or ``exp-decay`` (``exp(-(k - 1) / gamma)``)."""
    dpace_alpha: float = 0.5
    """Smoothing of D-PACE's confidence, in (0, 1]."""
    anchor_rule: str = "document"
    """``document``: the block lies inside the anchor's document, after its first token;
    ``packed``: any slot but the last ``block_size`` of the packed sequence (speculators)."""
    block_attention: str = "bidirectional"
    """Inside the block: ``bidirectional`` or ``causal`` (exported as
    ``sliding_window_non_causal``, which vLLM honours)."""
    train_region: str = "loss"
    """Which slots train: ``loss`` (anchors and labels where the loss mask is 1) or ``greedy``
    (anchors anywhere in a document; slot ``k`` trains iff every token between the anchor and
    its label is the verifier's own greedy token, so a served block could reach it)."""

    default_optimizer: ClassVar[str] = "muon"

    def check(self) -> None:
        super().check()
        self.choose("loss_weighting", ("exp-decay", "dpace"))
        self.choose("anchor_rule", ("document", "packed"))
        self.choose("block_attention", ("bidirectional", "causal"))
        self.choose("train_region", ("loss", "greedy"))
        if not 0.0 < self.dpace_alpha <= 1.0:
            raise ValueError(f"dpace_alpha: must be in (0, 1], got {self.dpace_alpha}")

    @staticmethod
    def model_class() -> type[DraftModel]:
        return DFlashDraft


class DFlashAttention(nn.Module):
    """Qwen3 attention whose keys/values also cover the injected verifier context."""

    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int, eps: float):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.q_proj = nn.Linear(hidden, heads * head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=False)
        self.q_norm = RMSNorm(head_dim, eps)
        self.k_norm = RMSNorm(head_dim, eps)

    def forward(self, x, ctx, rope_q, rope_k, mask: PreparedMask) -> torch.Tensor:
        Q = x.shape[0]
        q = self.q_norm(self.q_proj(x).view(Q, self.heads, self.head_dim)).transpose(0, 1)
        kv_in = torch.cat([ctx.to(x.dtype), x], dim=0)
        K = kv_in.shape[0]
        k = self.k_norm(self.k_proj(kv_in).view(K, self.kv_heads, self.head_dim)).transpose(0, 1)
        v = self.v_proj(kv_in).view(K, self.kv_heads, self.head_dim).transpose(0, 1)
        q = apply_rope(q, *rope_q)
        k = apply_rope(k, *rope_k)
        v = v.to(q.dtype)
        k = k.to(q.dtype)
        out = mask(q, k, v)
        return self.o_proj(out.transpose(0, 1).reshape(Q, self.heads * self.head_dim))


class DFlashLayer(nn.Module):
    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int, intermediate: int, eps: float):
        super().__init__()
        self.self_attn = DFlashAttention(hidden, heads, kv_heads, head_dim, eps)
        self.mlp = MLP(hidden, intermediate)
        self.input_layernorm = RMSNorm(hidden, eps)
        self.post_attention_layernorm = RMSNorm(hidden, eps)

    def forward(self, x, ctx, rope_q, rope_k, mask) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), ctx, rope_q, rope_k, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


def dflash_mask(
    doc_ids: torch.Tensor,
    anchors: torch.Tensor,
    anchor_docs: torch.Tensor,
    block_size: int,
    *,
    causal: bool = False,
    window: int | None = None,
) -> MaskSpec:
    """Queries: ``N`` blocks of ``block_size``; keys: ``S`` context slots then the ``N`` blocks.

    A query of block ``n`` sees context slot ``j`` iff ``j`` is in the anchor's document and
    ``j < anchors[n]`` (and ``j >= anchors[n] - window`` with a window), and the slots of its
    own block: all of them, or with ``causal`` those up to itself. Nothing else.
    """
    S, N, B = int(doc_ids.shape[0]), int(anchors.shape[0]), block_size

    def mask_mod(b, h, q_idx, kv_idx):
        n = q_idx // B
        a = anchors[n]
        d = anchor_docs[n]
        j = kv_idx.clamp(max=S - 1)
        ctx_ok = (kv_idx < S) & (doc_ids[j] == d) & (kv_idx < a)
        if window is not None:
            ctx_ok = ctx_ok & (kv_idx >= a - window)
        blk_ok = (kv_idx >= S) & ((kv_idx - S) // B == n)
        if causal:
            blk_ok = blk_ok & (kv_idx - S <= q_idx)
        return ctx_ok | blk_ok

    return MaskSpec(N * B, S + N * B, mask_mod, doc_ids.device)


class DFlashDraft(DraftModel):
    """The DFlash draft. ``forward(batch)`` trains; ``propose(context)`` drafts one block.

    Module names are exactly vLLM's: ``fc``, ``hidden_norm``, ``layers.{i}.*``, ``norm``.
    """

    config_class = DFlashConfig

    def __init__(self, cfg: DFlashConfig, verifier: VerifierHeads):
        super().__init__(cfg, verifier)
        if cfg.aux_layer_ids is None:
            raise ValueError("DFlashConfig.aux_layer_ids must be resolved (from the store) before building")
        if cfg.block_size < 2:
            raise ValueError(f"block_size must be >= 2, got {cfg.block_size}")
        H = self.resolve_decoder_shape()
        self.n_aux = len(cfg.aux_layer_ids)
        self.mask_token_id = cfg.mask_token_id if cfg.mask_token_id is not None else verifier.vocab_size - 1
        if not 0 <= self.mask_token_id < verifier.vocab_size:
            raise ValueError(
                f"mask_token_id {self.mask_token_id} outside the vocabulary of {verifier.vocab_size}"
            )
        self.gamma = cfg.loss_gamma if cfg.loss_gamma is not None else default_dflash_gamma(cfg.block_size)
        self.fc = nn.Linear(self.n_aux * H, H, bias=False)
        self.hidden_norm = RMSNorm(H, self.eps)
        self.layers = nn.ModuleList(
            DFlashLayer(H, self.heads, self.kv_heads, self.head_dim, self.intermediate, self.eps)
            for _ in range(cfg.num_layers)
        )
        self.norm = RMSNorm(H, self.eps)
        self.reduced = cfg.draft_vocab_size is not None and cfg.draft_vocab_size < verifier.vocab_size
        self.needs_token_counts = self.reduced
        if self.reduced:
            self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.int64))
            self.register_buffer("t2d", torch.zeros(verifier.vocab_size, dtype=torch.bool))
        self.reset_parameters()

    # ------------------------------------------------------------------ vocabulary

    def prepare(self, token_counts: torch.Tensor | None) -> None:
        """Build d2t/t2d from token counts when the draft vocabulary is reduced."""
        if not self.reduced:
            return
        if token_counts is None:
            raise ValueError("a reduced draft vocabulary needs token counts from the training data")
        d2t, t2d = build_vocab_map(token_counts, self.cfg.draft_vocab_size)
        self.d2t.copy_(d2t)
        self.t2d.copy_(t2d)

    def _draft_ids(self) -> torch.Tensor | None:
        return draft_to_target_ids(self.d2t) if self.reduced else None

    def _head_rows(self) -> torch.Tensor:
        """The frozen output rows (the verifier's LM head over the draft vocabulary)."""
        ids = self._draft_ids()
        return self.verifier.lm_head if ids is None else self.verifier.lm_head.index_select(0, ids)

    # ------------------------------------------------------------------ core

    def _dtype_in(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_autocast_enabled(x.device.type):
            return x
        return x.to(self.fc.weight.dtype)

    def context_features(self, aux: torch.Tensor) -> torch.Tensor:
        """``hidden_norm(fc(aux))`` for ``aux`` ``[T, n_aux, H]`` or ``[T, n_aux * H]``."""
        aux = aux.reshape(aux.shape[0], -1)
        if aux.shape[1] != self.fc.in_features:
            raise ValueError(f"aux hidden states have width {aux.shape[1]}, fc expects {self.fc.in_features}")
        return self.hidden_norm(self.fc(self._dtype_in(aux)))

    def _mask(self, doc_ids, anchors, anchor_docs, block: int | None = None) -> MaskSpec:
        cfg: DFlashConfig = self.cfg
        return dflash_mask(doc_ids, anchors, anchor_docs, block or cfg.block_size,
                           causal=cfg.block_attention == "causal", window=cfg.sliding_window)  # fmt: skip

    def _run_blocks(
        self, ctx, ctx_pos, anchor_tokens, anchor_pos, mask: PreparedMask, device, block: int | None = None
    ) -> torch.Tensor:
        """Draft layers over ``N`` blocks (of ``block`` slots, default ``block_size``); returns
        final-normed states ``[N, B, H]``."""
        N, B = int(anchor_tokens.shape[0]), block or self.cfg.block_size
        ids = torch.full((N, B), self.mask_token_id, dtype=torch.int64, device=device)
        ids[:, 0] = anchor_tokens
        x = self._dtype_in(self.verifier.embed(ids).reshape(N * B, -1))
        pos_q = (anchor_pos[:, None] + torch.arange(B, device=device)[None, :]).reshape(-1)
        rope_q = rope_cos_sin(pos_q, self.head_dim, self.theta)
        rope_k = rope_cos_sin(torch.cat([ctx_pos, pos_q]), self.head_dim, self.theta)
        for layer in self.layers:
            x = layer(x, ctx, rope_q, rope_k, mask)
        return self.norm(x).view(N, B, -1)

    def anchor_candidates(self, batch: Batch) -> torch.Tensor:
        """``[S]`` bool: the slots ``anchor_rule`` allows as anchors (trained, :meth:`trained_slots`, and
        room for a block)."""
        B = self.cfg.block_size
        slots = torch.arange(batch.seq_len, device=batch.input_ids.device)
        trained = self.trained_slots(batch)
        if self.cfg.anchor_rule == "packed":
            return trained & (slots + B < batch.seq_len)
        return trained & (batch.doc_ids >= 0) & (slots + B <= batch.doc_ends) & (batch.position_ids >= 1)

    def trained_slots(self, batch: Batch) -> torch.Tensor:
        """``[S]`` bool: the slots ``train_region`` trains (the loss mask, or every document slot)."""
        return batch.loss_mask.bool() if self.cfg.train_region == "loss" else batch.doc_ids >= 0

    def draw_anchors(
        self, batch: Batch, generator: torch.Generator | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(anchors [N], valid [N])``, ``N = min(max_anchors, S)``: up to ``max_anchors`` slots drawn
        uniformly from :meth:`anchor_candidates`, ascending, then padding (slot 0, not valid).

        Fixed shapes on the batch's device, no host-device sync. The ``i``-th candidate (in slot
        order) scores ``rand(S)[i]`` and the top ``max_anchors`` scores win, so where there are
        more candidates than anchors a CPU generator draws what it drew before shapes were fixed.
        """
        cand = self.anchor_candidates(batch)
        S, device = batch.seq_len, cand.device
        n = min(self.cfg.max_anchors, S)
        noise = torch.rand(
            S, generator=generator, device=generator.device if generator is not None else device
        )
        noise = noise.to(device, non_blocking=True)
        rank = (torch.cumsum(cand, 0) - 1).clamp(min=0)
        score = torch.where(cand, noise[rank], -1.0)
        top = score.topk(n).indices
        slots = torch.where(cand[top], top, S).sort().values
        valid = slots < S
        return torch.where(valid, slots, 0), valid

    def sample_anchors(self, batch: Batch, generator: torch.Generator | None = None) -> torch.Tensor:
        """The valid anchors of :meth:`draw_anchors`, sorted (reads their count: a sync on CUDA)."""
        anchors, valid = self.draw_anchors(batch, generator)
        return anchors[valid]

    def draw(self, batch: Batch, generator: torch.Generator | None = None):
        """``(anchors, valid, mask)``: :meth:`draw_anchors` and the blocks' attention mask."""
        anchors, valid = self.draw_anchors(batch, generator)
        return anchors, valid, self._prepared_mask(batch, anchors, valid)

    def _prepared_mask(self, batch: Batch, anchors: torch.Tensor, anchor_valid: torch.Tensor) -> PreparedMask:
        anchor_docs = torch.where(anchor_valid, batch.doc_ids[anchors], torch.full_like(anchors, -2))
        spec = self._mask(batch.doc_ids, anchors, anchor_docs)
        return PreparedMask(spec, self.backend(batch.input_ids.device))

    def block_states(
        self,
        batch: Batch,
        anchors: torch.Tensor,
        anchor_valid: torch.Tensor,
        mask: PreparedMask | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The draft's states for the ``N`` blocks at ``anchors`` and what they are trained on.

        Returns:
            ``h [N, B-1, H]`` (position ``k`` predicts the token ``k`` after the anchor),
            ``label_slots [N, B-1]`` (slot of that token: the verifier's state one slot before
            it gives the target) and ``valid [N, B-1]`` (the label's loss mask, in a real block).
        """
        device = batch.input_ids.device
        B = self.cfg.block_size
        if mask is None:
            mask = self._prepared_mask(batch, anchors, anchor_valid)
        ctx = self.context_features(batch.aux_hidden)
        out = self._run_blocks(ctx, batch.position_ids, batch.input_ids[anchors], batch.position_ids[anchors],
                               mask, device)  # fmt: skip
        k = torch.arange(1, B, device=device)
        label_slots = (anchors[:, None] + k[None, :]).clamp(max=batch.seq_len - 1)
        if self.cfg.train_region == "loss":
            valid = batch.loss_mask[label_slots].bool() & anchor_valid[:, None]
        else:
            in_doc = batch.doc_ids[label_slots] == batch.doc_ids[anchors][:, None]
            valid = in_doc & (batch.doc_ids[label_slots] >= 0) & anchor_valid[:, None]
        return out[:, 1:], label_slots, valid

    def position_weights(self, loss: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """``[N, B-1]`` loss weights (0 where not valid) of the configured ``loss_weighting``."""
        cfg: DFlashConfig = self.cfg
        if cfg.loss_weighting == "dpace":
            return dpace_weights(loss, valid, cfg.dpace_alpha)
        decay = loss_decay_weights(cfg.block_size - 1, self.gamma, loss.device)
        return decay[None, :].to(loss.dtype) * valid.to(loss.dtype)

    def training_loss(
        self, batch: Batch, draws
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor], dict[str, Any]]:
        """Loss on one packed sequence, and metric sums over the drawn anchors (padding anchors
        weigh nothing: a sequence without any gives loss 0, zero gradients and zero sums)."""
        anchors, anchor_valid, mask = draws
        K = self.cfg.block_size - 1
        h, label_slots, valid = self.block_states(batch, anchors, anchor_valid, mask)
        N = h.shape[0]
        head = self._head_rows()
        if batch.target_ids is not None:  # a store of target ids: the verifier's argmax, stored
            if self.cfg.target_mode != "hard":
                raise ValueError(
                    "soft targets need the verifier's final layer; this batch has target ids only"
                )
            ids, known = stored_target_ids(batch.target_ids[label_slots - 1].reshape(-1), self._draft_ids(),
                                           self.verifier.vocab_size)  # fmt: skip
            valid = valid & known.view(N, K)
            rows, pred, tgt = vocab_loss(
                h.reshape(N * K, -1), head, mode="hard", targets=VerifierTargets(ids)
            )
        else:
            target_hidden = self.verifier.norm(batch.last_hidden[label_slots - 1].reshape(N * K, -1))
            rows, pred, tgt = vocab_loss(h.reshape(N * K, -1), head, target_hidden, head, self.cfg.target_mode,
                                         target_softcap=self.verifier.softcap)  # fmt: skip
        rows = rows.view(N, K)
        if self.cfg.train_region == "greedy":
            ids = self._draft_ids()
            agree = batch.input_ids[label_slots] == (tgt if ids is None else ids[tgt]).view(N, K)
            valid = valid & greedy_reach(agree)
        w = self.position_weights(rows, valid)
        weight_sum = valid.sum().to(rows.dtype) if self.cfg.loss_norm == "count" else w.sum()
        denom = weight_sum + 1e-5 if self.cfg.loss_norm == "count" else weight_sum.clamp_min(1e-6)
        loss = (rows * w).sum() / denom
        correct = (pred == tgt).view(N, K)
        draft_ids = self._draft_ids()
        if draft_ids is not None:
            pred = draft_ids[pred]
        metrics = chain_metrics(correct, valid)
        metrics["loss_sum"] = (rows.detach() * w).sum().double()
        metrics["weight_sum"] = weight_sum.detach().double()  # 0 without anchors, as on a rank with none
        outputs = {"anchors": anchors, "anchor_valid": anchor_valid, "predictions": pred.view(N, K),
                   "flops": self._flops(batch, anchors, anchor_valid)}  # fmt: skip
        return loss, metrics, outputs

    @property
    def last_anchors(self) -> torch.Tensor:
        """The valid anchors of the last forward (reads their count: a sync on CUDA)."""
        return self.last_outputs["anchors"][self.last_outputs["anchor_valid"]]

    @property
    def last_predictions(self) -> torch.Tensor:
        """``[anchors, B-1]`` greedy proposals (verifier ids) of the last forward's valid blocks."""
        return self.last_outputs["predictions"][self.last_outputs["anchor_valid"]]

    def _flops(self, batch: Batch, anchors: torch.Tensor, anchor_valid: torch.Tensor) -> torch.Tensor:
        """Matmul FLOPs of the valid blocks, forward + backward (a float64 device tensor)."""
        B, H, S = self.cfg.block_size, self.hidden, batch.seq_len
        n = anchor_valid.sum().double()
        Q = n * B
        qd, kvd = self.heads * self.head_dim, self.kv_heads * self.head_dim
        ctx_keys = (batch.position_ids[anchors] * anchor_valid).sum().double() + n * B
        pairs = ctx_keys * B
        layer = 2 * Q * H * qd * 2 + 2 * (S + Q) * H * kvd * 2 + 2 * Q * H * self.intermediate * 3
        layer = layer + 4 * pairs * qd
        vocab = self.cfg.draft_vocab_size if self.reduced else self.verifier.vocab_size
        rows = n * (B - 1)
        head = 2 * rows * H * vocab * 3  # draft head forward + input gradient, verifier head forward
        fc = 2 * S * self.fc.in_features * H
        return 3.0 * (len(self.layers) * layer + fc) + head

    @property
    def max_proposals(self) -> int:
        """Most tokens one block proposes (``block_size - 1``: the anchor is given)."""
        return self.cfg.block_size - 1

    @torch.no_grad()
    def propose(self, context: DraftContext, num_tokens: int | None = None) -> list[int]:
        """Draft one block in ONE forward pass.

        Args:
            context: ``aux_hidden_states`` ``[T, n_aux * H]`` (verifier aux-layer states of the
                context positions ``0..T-1``) and ``token_ids`` (``T + 1`` ids; only the last,
                the bonus token the verifier produced from position ``T - 1``, is used: it is
                the anchor at position ``T``).
            num_tokens: how many to return, at most (default) ``block_size - 1``.

        Returns:
            ``num_tokens`` greedy proposals (verifier vocabulary ids) for positions ``T+1...``.
        """
        B = self.cfg.block_size
        n = B - 1 if num_tokens is None else num_tokens
        if not 0 < n <= B - 1:
            raise ValueError(f"DFlash proposes 1..{B - 1} tokens per block, asked for {n}")
        out = self.propose_block(context, B)
        draft_ids = self._draft_ids()
        h = out[1 : n + 1]
        pred = torch.nn.functional.linear(h, self._head_rows().to(h.dtype)).argmax(-1)
        if draft_ids is not None:
            pred = draft_ids[pred]
        return [int(t) for t in pred.tolist()]

    def propose_block(self, context: DraftContext, block: int) -> torch.Tensor:
        """The final-normed states ``[block, H]`` of one block ``[anchor, MASK x (block - 1)]`` at
        positions ``T..T+block-1`` after ``context`` (the anchor is its last token id).

        With FlexAttention the context is padded to :func:`~spectrain.models.layers.context_bucket`
        slots (masked out), so a decode loop reuses one compiled kernel per bucket.
        """
        device = self.fc.weight.device
        aux = torch.as_tensor(context.aux_hidden_states).to(device)
        T = aux.shape[0]
        if T < 1:
            raise ValueError(f"{self.cfg.algorithm} needs at least one context position")
        tokens = torch.as_tensor(context.token_ids, dtype=torch.int64, device=device)
        if tokens.numel() != T + 1:
            raise ValueError(
                f"token_ids must hold T + 1 = {T + 1} ids (context + bonus), got {tokens.numel()}"
            )
        ctx = self.context_features(aux)
        doc = torch.zeros(T, dtype=torch.int64, device=device)
        ctx_pos = torch.arange(T, device=device)
        backend = self.backend(device)
        if backend == "flex":  # padded slots: outside the document, so no query sees them
            pad = context_bucket(T) - T
            ctx = torch.nn.functional.pad(ctx, (0, 0, 0, pad))
            doc = torch.nn.functional.pad(doc, (0, pad), value=-1)
            ctx_pos = torch.nn.functional.pad(ctx_pos, (0, pad))
        anchor = torch.tensor([T], device=device)
        spec = self._mask(doc, anchor, torch.zeros(1, dtype=torch.int64, device=device), block)
        mask = PreparedMask(spec, backend)
        return self._run_blocks(ctx, ctx_pos, tokens[-1:], anchor, mask, device, block)[0]

    # ------------------------------------------------------------------ export

    def vllm_state_dict(self, state: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        sd = dict(self.state_dict() if state is None else state)
        if self.reduced:
            d2t = sd["d2t"].to(self.verifier.lm_head.device)
            sd["lm_head.weight"] = self.verifier.lm_head.index_select(0, draft_to_target_ids(d2t)).detach()
        return sd

    def vllm_config(self, verifier_name: str, architectures: Sequence[str]) -> dict[str, Any]:
        info = self.verifier.info
        cfg: DFlashConfig = self.cfg
        layer_cfg = qwen3_layer_config(
            info, self.hidden, len(self.layers), self.heads, self.kv_heads, self.head_dim, self.intermediate
        )
        if cfg.sliding_window is not None:
            layer_cfg.update(layer_types=["sliding_attention"] * len(self.layers), use_sliding_window=True,
                             sliding_window=cfg.sliding_window)  # fmt: skip
        return {
            "architectures": ["DFlashDraftModel"],
            "speculators_model_type": "dflash",
            "transformer_layer_config": layer_cfg,
            "speculators_config": speculators_config(
                "dflash", cfg.block_size - 1, verifier_name, architectures
            ),
            "draft_vocab_size": cfg.draft_vocab_size if self.reduced else info.vocab_size,
            "target_hidden_size": None if info.hidden_size == self.hidden else info.hidden_size,
            "aux_hidden_state_layer_ids": list(cfg.aux_layer_ids),
            "mask_token_id": self.mask_token_id,
            "block_size": cfg.block_size,
            "sample_from_anchor": False,
            "sliding_window_non_causal": cfg.block_attention == "bidirectional",
            "torch_dtype": "bfloat16",
        }
