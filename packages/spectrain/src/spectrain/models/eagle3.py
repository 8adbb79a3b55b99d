"""Eagle3: a one-layer autoregressive draft fed by three verifier layers.

Position ``t`` of the draft takes ``fc(concat(aux states at t))`` (optionally RMS-normed first:
``norm_before_fc``) and the embedding of token ``t + 1`` (normed separately and concatenated to
``2 * hidden``) and predicts token ``t + 2`` over a reduced draft vocabulary (``d2t``/``t2d``,
the most frequent tokens of the training data). Training-time test runs ``ttt_steps`` steps:
step ``j`` feeds the draft's own output of step ``j - 1`` (pre-norm, or post-norm with
``norm_output``) back in with the embedding of token ``t + j + 1``, attends to the
verifier-fed keys up to ``t`` plus its own chain (the diagonal of earlier steps), and is
weighted ``ttt_step_loss_decay ** j``. Targets are the verifier's distribution
``lm_head(norm(h_last))`` restricted to the draft vocabulary. Module names equal vLLM's
``Eagle3LlamaForCausalLM`` weight names.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from spectrain.data.batch import Batch
from spectrain.models.common import build_vocab_map, chain_metrics, draft_to_target_ids, stored_target_ids
from spectrain.models.layers import MLP, MaskSpec, PreparedMask, RMSNorm, apply_rope, rope_cos_sin
from spectrain.models.registry import DraftConfig, DraftContext, DraftModel, register
from spectrain.models.served_config import qwen3_layer_config, speculators_config
from spectrain.models.verifier import VerifierHeads
from spectrain.models.vocab_loss import VerifierTargets, verifier_targets, vocab_loss

log = logging.getLogger(__name__)


@register("eagle3")
@dataclass
class Eagle3Config(DraftConfig):
    """Eagle3 options (the shared ones are documented on :class:`DraftConfig`)."""

    num_layers: int = 1
    draft_vocab_size: int | None = 32000
    """Draft vocabulary size (clamped to the verifier's vocabulary)."""
    ttt_steps: int = 3
    """Training-time-test steps (the first is the ordinary next-token step)."""
    target_mode: str = "hard"
    ttt_step_loss_decay: float = 0.8
    """Loss weight of step ``j`` is ``ttt_step_loss_decay ** j``."""
    norm_before_residual: bool = True
    """Residual taken after ``hidden_norm`` (vLLM's default)."""
    norm_before_fc: bool = False
    """RMSNorm (``input_norm``) over the concatenated auxiliary states before ``fc`` (Eagle 3.1)."""
    norm_output: bool = False
    """Feed the post-norm output of a step to the next one (Eagle 3.1), not the pre-norm one."""
    freeze_lm_head: bool = True
    """Keep ``lm_head`` at the verifier's rows (no gradient, no optimizer state)."""
    loss_mask_on: str = "label"
    """Which loss-mask slot trains step ``j`` at ``t``: the predicted token's (``label``,
    ``t + j + 2``) or the verifier position giving the target (``source``, ``t + j + 1``,
    speculators)."""

    train_region: str = "greedy"
    """Which slots train: ``greedy`` (every slot of a document whose label the chain reaches
    through the verifier's own greedy tokens, prompts included) or ``loss`` (as ``loss_mask_on``
    says). ``greedy`` is the default by measurement (docs/decisions.md)."""

    RETIRED: ClassVar[tuple[str, ...]] = ("logits_chunk",)

    @classmethod
    def from_dict(cls, d: dict[str, Any], *, where: str = "config") -> Eagle3Config:
        """As :meth:`DraftConfig.from_dict`; options that name ``loss_mask_on`` but no ``train_region``
        (a checkpoint's config from before ``train_region`` existed, or a run that sets the loss mask's
        slot) train the loss region, the only one ``loss_mask_on`` applies to."""
        if "loss_mask_on" in d and "train_region" not in d:
            d = {**d, "train_region": "loss"}
        return super().from_dict(d, where=where)

    def check(self) -> None:
        super().check()
        self.choose("loss_mask_on", ("label", "source"))
        self.choose("train_region", ("loss", "greedy"))
        if self.train_region == "greedy" and self.loss_mask_on != "label":
            raise ValueError(
                f"loss_mask_on: {self.loss_mask_on!r} applies to train_region 'loss' only (greedy "
                "trains by the verifier's tokens, not the loss mask); set train_region='loss'"
            )
        if self.ttt_steps < 1:
            raise ValueError(f"ttt_steps: must be >= 1, got {self.ttt_steps}")

    @staticmethod
    def model_class() -> type[DraftModel]:
        return Eagle3Draft


class Eagle3Attention(nn.Module):
    """Llama attention over ``2 * hidden`` inputs (no q/k norm)."""

    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.q_proj = nn.Linear(2 * hidden, heads * head_dim, bias=False)
        self.k_proj = nn.Linear(2 * hidden, kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(2 * hidden, kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=False)

    def qkv(self, x: torch.Tensor, rope) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        T = x.shape[0]
        q = self.q_proj(x).view(T, self.heads, self.head_dim).transpose(0, 1)
        k = self.k_proj(x).view(T, self.kv_heads, self.head_dim).transpose(0, 1)
        v = self.v_proj(x).view(T, self.kv_heads, self.head_dim).transpose(0, 1)
        return apply_rope(q, *rope), apply_rope(k, *rope).to(q.dtype), v.to(q.dtype)


class Eagle3Layer(nn.Module):
    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int, intermediate: int, eps: float,
                 norm_before_residual: bool):  # fmt: skip
        super().__init__()
        self.self_attn = Eagle3Attention(hidden, heads, kv_heads, head_dim)
        self.mlp = MLP(hidden, intermediate)
        self.hidden_norm = RMSNorm(hidden, eps)
        self.input_layernorm = RMSNorm(hidden, eps)
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        self.norm_before_residual = norm_before_residual

    def pre_attention(self, embeds: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(attention input [T, 2H], residual [T, H])``."""
        e = self.input_layernorm(embeds)
        hn = self.hidden_norm(hidden)
        residual = hn if self.norm_before_residual else hidden
        return torch.cat([e, hn.to(e.dtype)], dim=-1), residual

    def post_attention(self, attn: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """Pre-norm output (``mlp(norm(attn + residual)) + attn + residual``)."""
        T = attn.shape[1]
        o = self.self_attn.o_proj(attn.transpose(0, 1).reshape(T, -1))
        residual = residual + o
        return residual + self.mlp(self.post_attention_layernorm(residual))


def ttt_mask(doc_ids: torch.Tensor, step: int, window: int | None = None) -> MaskSpec:
    """Step ``step`` queries ``[S]`` over keys of steps ``0..step`` (``(step + 1) * S``).

    Query ``t`` sees step-0 keys ``s <= t`` of its document (and ``s > t - window`` with a
    window), and the key at ``t`` itself of every step (its own draft chain). A padding query
    sees only its own keys.
    """
    S = int(doc_ids.shape[0])

    def mask_mod(b, h, q_idx, kv_idx):
        st = kv_idx // S
        s = kv_idx % S
        first = (st == 0) & (doc_ids[s] == doc_ids[q_idx]) & (doc_ids[q_idx] >= 0) & (s <= q_idx)
        if window is not None:
            first = first & (s > q_idx - window)
        return first | (s == q_idx)

    return MaskSpec(S, (step + 1) * S, mask_mod, doc_ids.device)


class Eagle3Draft(DraftModel):
    """The Eagle3 draft. ``forward(batch)`` trains; ``propose(context, k)`` drafts a chain."""

    config_class = Eagle3Config
    needs_token_counts = True

    def __init__(self, cfg: Eagle3Config, verifier: VerifierHeads):
        super().__init__(cfg, verifier)
        if cfg.aux_layer_ids is None:
            raise ValueError("Eagle3Config.aux_layer_ids must be resolved (from the store) before building")
        if len(cfg.aux_layer_ids) != 3:
            raise ValueError(f"Eagle3 uses exactly 3 auxiliary layers, got {list(cfg.aux_layer_ids)}")
        if cfg.num_layers != 1:
            raise ValueError(f"Eagle3 has one decoder layer (vLLM), got num_layers={cfg.num_layers}")
        H = self.resolve_decoder_shape()
        vocab = verifier.vocab_size
        dv = cfg.draft_vocab_size or vocab
        if dv > vocab:
            log.info("draft_vocab_size %d > verifier vocabulary %d; using %d", dv, vocab, vocab)
            dv = vocab
        self.draft_vocab = dv
        self.fc = nn.Linear(3 * H, H, bias=False)
        self.layers = nn.ModuleList(
            [Eagle3Layer(H, self.heads, self.kv_heads, self.head_dim, self.intermediate, self.eps,
                         cfg.norm_before_residual)]
        )  # fmt: skip
        self.norm = RMSNorm(H, self.eps)
        self.input_norm = RMSNorm(3 * H, self.eps) if cfg.norm_before_fc else None
        self.lm_head = nn.Linear(H, dv, bias=False)
        if cfg.freeze_lm_head:  # the verifier's rows in its dtype: no fp32 master copy, no gradient
            self.lm_head.weight = nn.Parameter(
                torch.empty(dv, H, dtype=verifier.lm_head.dtype, device=self.lm_head.weight.device),
                requires_grad=False,
            )
        self.register_buffer("d2t", torch.zeros(dv, dtype=torch.int64))
        self.register_buffer("t2d", torch.zeros(vocab, dtype=torch.bool))
        self.reset_parameters()
        self.prepare(None)

    def prepare(self, token_counts: torch.Tensor | None) -> None:
        """Build d2t/t2d from token counts and start ``lm_head`` from the verifier's rows."""
        if token_counts is None:  # counts live on the host, whatever the default device is
            token_counts = torch.zeros(self.verifier.vocab_size, device="cpu")
        d2t, t2d = build_vocab_map(token_counts.cpu(), self.draft_vocab)
        self.d2t.copy_(d2t)
        self.t2d.copy_(t2d)
        with torch.no_grad():
            rows = self.verifier.lm_head.index_select(
                0, draft_to_target_ids(d2t).to(self.verifier.lm_head.device)
            )
            self.lm_head.weight.copy_(rows.to(self.lm_head.weight.dtype))

    @property
    def layer(self) -> Eagle3Layer:
        return self.layers[0]

    def _dtype_in(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_autocast_enabled(x.device.type):
            return x
        return x.to(self.fc.weight.dtype)

    def context_features(self, aux: torch.Tensor) -> torch.Tensor:
        """``fc(aux)`` (``fc(input_norm(aux))`` with ``norm_before_fc``) for ``aux [T, 3 * H]``."""
        x = self._dtype_in(aux)
        if self.input_norm is not None:
            x = self.input_norm(x)
        return self.fc(x)

    def step_slots(self, batch: Batch, j: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(source [S], inside [S], valid [S])`` of TTT step ``j``: at slot ``t`` the step reads
        token ``source = t + j + 1`` (clamped; ``inside`` its document) and is trained, where
        ``valid``, on the verifier's distribution at that slot."""
        S = batch.seq_len
        slots = torch.arange(S, device=batch.input_ids.device)
        src = slots + j + 1
        inside = (batch.doc_ids >= 0) & (src < batch.doc_ends)
        src_c = src.clamp(max=S - 1)
        if self.cfg.train_region == "greedy":
            return src_c, inside, inside & (slots + j + 2 < batch.doc_ends)
        if self.cfg.loss_mask_on == "source":
            return src_c, inside, inside & batch.loss_mask[src_c].bool()
        lab = slots + j + 2
        valid = inside & (lab < batch.doc_ends) & batch.loss_mask[lab.clamp(max=S - 1)].bool()
        return src_c, inside, valid

    def draw(self, batch: Batch, generator: torch.Generator | None = None) -> list[PreparedMask]:
        """The attention mask of each TTT step (no random draws)."""
        backend = self.backend(batch.input_ids.device)
        return [PreparedMask(ttt_mask(batch.doc_ids, j, self.cfg.sliding_window), backend)
                for j in range(self.cfg.ttt_steps)]  # fmt: skip

    def training_loss(
        self, batch: Batch, draws
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor], dict[str, Any]]:
        """TTT loss on one packed sequence, and metric sums (chains start at every valid slot).

        The verifier's targets over the draft vocabulary are formed once for all ``S`` slots; step
        ``j`` reads them shifted by ``j`` (a TTT step at ``t`` is trained on slot ``t + j + 1``).
        """
        cfg: Eagle3Config = self.cfg
        masks = draws if draws is not None else self.draw(batch)
        device = batch.input_ids.device
        S, K = batch.seq_len, cfg.ttt_steps
        draft_ids = draft_to_target_ids(self.d2t)
        known = None
        if batch.target_ids is not None:  # a store of target ids: the verifier's argmax, stored
            if cfg.target_mode != "hard":
                raise ValueError(
                    "soft targets need the verifier's final layer; this batch has target ids only"
                )
            ids, known = stored_target_ids(batch.target_ids, draft_ids, self.verifier.vocab_size)
            targets = VerifierTargets(ids)
        else:
            with torch.no_grad():
                target_hidden = self.verifier.norm(batch.last_hidden)
            targets = verifier_targets(
                target_hidden,
                self.verifier.lm_head.index_select(0, draft_ids),
                cfg.target_mode,
                softcap=self.verifier.softcap,
            )
        path = agree = None
        if cfg.train_region == "greedy":
            slots = torch.arange(S, device=device)
            nxt = (slots + 1).clamp(max=S - 1)
            agree = (slots + 1 < batch.doc_ends) & (batch.input_ids[nxt] == draft_ids[targets.ids])
            if known is not None:
                agree = agree & known
            path = torch.ones(S, dtype=torch.bool, device=device)
        hidden = self.context_features(batch.aux_hidden.reshape(S, -1))
        keys, values = [], []
        total = hidden.new_zeros((), dtype=torch.promote_types(hidden.dtype, torch.float32))
        wsum = 0.0
        corrects, valids, preds = [], [], []
        loss_sum = torch.zeros((), dtype=torch.float64, device=device)
        for j in range(K):
            src_c, inside, valid = self.step_slots(batch, j)
            if known is not None:
                valid = valid & known[src_c]
            if path is not None:
                valid = valid & path
                path = path & agree[src_c]
            tok = torch.where(inside, batch.input_ids[src_c], torch.zeros_like(src_c))
            x, residual = self.layer.pre_attention(self._dtype_in(self.verifier.embed(tok)), hidden)
            rope = rope_cos_sin(batch.position_ids + j, self.head_dim, self.theta)
            q, k, v = self.layer.self_attn.qkv(x, rope)
            keys.append(k)
            values.append(v)
            attn = masks[j](q, torch.cat(keys, dim=1), torch.cat(values, dim=1))
            prenorm = self.layer.post_attention(attn, residual)
            normed = self.norm(prenorm)
            rows, pred, tgt = vocab_loss(normed, self.lm_head.weight, mode=cfg.target_mode,
                                         targets=targets.take(src_c))  # fmt: skip
            w = valid.to(rows.dtype)
            denom = w.sum() + 1e-5 if cfg.loss_norm == "count" else w.sum().clamp_min(1.0)
            step_w = cfg.ttt_step_loss_decay**j
            total = total + step_w * (rows * w).sum() / denom
            wsum += step_w
            loss_sum = loss_sum + (rows.detach() * w).sum().double()
            preds.append(draft_ids[pred])
            corrects.append(pred == tgt)
            valids.append(valid)
            hidden = normed if cfg.norm_output else prenorm
        loss = total / wsum if cfg.loss_norm == "weight" else total
        metrics = chain_metrics(torch.stack(corrects, 1), torch.stack(valids, 1))
        metrics["loss_sum"] = loss_sum
        metrics["weight_sum"] = torch.stack(valids).sum().double()
        return loss, metrics, {"predictions": torch.stack(preds, 1), "flops": self._flops(batch)}

    @property
    def last_predictions(self) -> torch.Tensor:
        """``[S, K]`` the last forward's greedy proposals (verifier ids) of every TTT step."""
        return self.last_outputs["predictions"]

    def _flops(self, batch: Batch) -> torch.Tensor:
        """Matmul FLOPs of forward + backward (a float64 device tensor)."""
        H, S, K = self.hidden, batch.seq_len, self.cfg.ttt_steps
        qd, kvd = self.heads * self.head_dim, self.kv_heads * self.head_dim
        real = batch.doc_ids >= 0
        pairs0 = ((batch.position_ids + 1) * real).sum().double()
        per_step = 2 * S * 2 * H * (qd + 2 * kvd) + 2 * S * qd * H + 2 * S * H * self.intermediate * 3
        attn = sum(4 * qd * (pairs0 + j * S) for j in range(K))
        trainable = K * per_step + attn + 2 * S * 3 * H * H
        head = 2 * S * H * self.draft_vocab
        head_passes = 2 if self.cfg.freeze_lm_head else 3  # forward, input gradient (, weight gradient)
        return 3.0 * trainable + K * head * head_passes + head  # + the verifier's rows, once

    @torch.no_grad()
    def propose(self, context: DraftContext, num_tokens: int | None = None) -> list[int]:
        """Draft a greedy chain of ``num_tokens`` tokens (default ``ttt_steps``), recomputing each step.

        Args:
            context: ``aux_hidden_states`` ``[T, 3 * H]`` (verifier aux-layer states of context
                positions ``0..T-1``) and ``token_ids`` (``T + 1`` ids: the context tokens and,
                last, the bonus token the verifier produced from position ``T - 1``).
            num_tokens: chain length K.

        Returns:
            ``K`` proposals (verifier vocabulary ids) for positions ``T+1 .. T+K``.
        """
        n = self.cfg.ttt_steps if num_tokens is None else num_tokens
        if n < 1:
            raise ValueError(f"num_tokens must be >= 1, got {n}")
        device = self.fc.weight.device
        aux = torch.as_tensor(context.aux_hidden_states).to(device)
        T = aux.shape[0]
        tokens = torch.as_tensor(context.token_ids, dtype=torch.int64, device=device)
        if T < 1 or tokens.numel() != T + 1:
            raise ValueError(f"need T >= 1 aux rows and T + 1 token ids, got {T} and {tokens.numel()}")
        hidden = self.context_features(aux.reshape(T, -1))
        ids = tokens[1:]
        draft_ids = draft_to_target_ids(self.d2t)
        out: list[int] = []
        for _ in range(n):
            L = ids.shape[0]
            x, residual = self.layer.pre_attention(self._dtype_in(self.verifier.embed(ids)), hidden)
            q, k, v = self.layer.self_attn.qkv(x, rope_cos_sin(torch.arange(L, device=device), self.head_dim,
                                                                self.theta))  # fmt: skip
            pos = torch.arange(L, device=device)
            causal = pos[None, :] <= pos[:, None]
            if self.cfg.sliding_window is not None:
                causal = causal & (pos[None, :] > pos[:, None] - self.cfg.sliding_window)
            attn = F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=causal,
                                                  enable_gqa=self.heads != self.kv_heads)[0]  # fmt: skip
            prenorm = self.layer.post_attention(attn, residual)
            normed = self.norm(prenorm[-1:])
            nxt = draft_ids[F.linear(normed, self.lm_head.weight.to(normed.dtype)).argmax(-1)]
            out.append(int(nxt.item()))
            fed = normed if self.cfg.norm_output else prenorm[-1:]
            hidden = torch.cat([hidden, fed.to(hidden.dtype)])
            ids = torch.cat([ids, nxt])
        return out

    # ------------------------------------------------------------------ export

    def vllm_state_dict(self, state: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        return dict(self.state_dict() if state is None else state)

    def vllm_config(self, verifier_name: str, architectures: Sequence[str]) -> dict[str, Any]:
        info = self.verifier.info
        cfg: Eagle3Config = self.cfg
        layer_cfg = qwen3_layer_config(
            info,
            self.hidden,
            1,
            self.heads,
            self.kv_heads,
            self.head_dim,
            self.intermediate,
            model_type="llama",
        )
        if cfg.sliding_window is not None:
            layer_cfg.update(layer_types=["sliding_attention"], use_sliding_window=True,
                             sliding_window=cfg.sliding_window)  # fmt: skip
        return {
            "architectures": ["Eagle3Speculator"],
            "speculators_model_type": "eagle3",
            "transformer_layer_config": layer_cfg,
            "speculators_config": speculators_config("eagle3", cfg.ttt_steps, verifier_name, architectures),
            "draft_vocab_size": self.draft_vocab,
            "target_hidden_size": None if info.hidden_size == self.hidden else info.hidden_size,
            "eagle_aux_hidden_state_layer_ids": list(cfg.aux_layer_ids),
            "norm_before_residual": cfg.norm_before_residual,
            "norm_before_fc": cfg.norm_before_fc,
            "fc_norm": False,
            "norm_output": cfg.norm_output,
            "torch_dtype": "bfloat16",
        }
