"""DSpark's two small heads: the Markov head (a low-rank logit bias from the previous token) and the
confidence head (one acceptance logit per slot).

Every Markov variant ends in the same projection ``markov_w2``: the bias on a slot's draft logits
is ``markov_w2(u)`` for an ``r``-wide feature ``u`` of the previous token (and, gated and rnn, of
the slot's state). The training loss therefore treats ``u`` as ``r`` extra input columns of the
vocabulary head (``[h; u] @ [W_head; markov_w2]^T``), and decoding adds ``markov_w2(u)`` slot by
slot. Module names are speculators' and vLLM's (``markov_head.markov_w1`` ...).
"""

from __future__ import annotations

import torch
from torch import nn


class MarkovHead(nn.Module):
    """``markov_w1``: ``[verifier vocab, r]`` embedding of the previous token (a verifier id);
    ``markov_w2``: ``[draft vocab, r]``; ``gate_proj`` (gated) or ``joint_proj`` (rnn)."""

    def __init__(self, kind: str, verifier_vocab: int, draft_vocab: int, rank: int, hidden: int):
        super().__init__()
        self.kind, self.rank = kind, rank
        self.markov_w1 = nn.Embedding(verifier_vocab, rank)
        self.markov_w2 = nn.Linear(rank, draft_vocab, bias=False)
        if kind == "gated":
            self.gate_proj = nn.Linear(hidden + rank, rank)
        elif kind == "rnn":
            self.joint_proj = nn.Linear(2 * rank + hidden, 3 * rank)
        elif kind != "vanilla":
            raise ValueError(f"markov_head_type: {kind!r} is not vanilla | gated | rnn")

    def reset_parameters(self, std: float = 0.02) -> None:
        """``markov_w1`` N(0, 0.01) (speculators' init), the projections N(0, ``std``), biases 0."""
        nn.init.normal_(self.markov_w1.weight, std=0.01)
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=std)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)

    def embed(self, prev_ids: torch.Tensor) -> torch.Tensor:
        """``W1[prev]``: ``[...]`` verifier ids -> ``[..., r]``."""
        return self.markov_w1(prev_ids.long())

    def step(
        self, emb: torch.Tensor, hidden: torch.Tensor, state: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One slot: ``(u, new state)`` from ``emb = W1[prev]`` ``[M, r]`` and the slot's draft
        state ``hidden`` ``[M, H]`` (rnn: ``state`` ``[M, r]``, None before the first slot)."""
        emb = emb.to(self.markov_w2.weight.dtype) if not torch.is_autocast_enabled(emb.device.type) else emb
        if self.kind == "vanilla":
            return emb, None
        hidden = hidden.to(emb.dtype)
        if self.kind == "gated":
            return torch.sigmoid(self.gate_proj(torch.cat([hidden, emb], dim=-1))) * emb, None
        if state is None:
            state = emb.new_zeros(emb.shape[0], self.rank)
        gate, cand, out = self.joint_proj(torch.cat([state, emb, hidden], dim=-1)).chunk(3, dim=-1)
        gate = torch.sigmoid(gate)
        state = gate * state + (1.0 - gate) * torch.tanh(cand)
        return torch.tanh(out), state

    def block_features(
        self, prev_ids: torch.Tensor, hidden: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(u, emb)`` ``[N, B, r]`` for blocks of previous tokens ``[N, B]`` and slot states
        ``[N, B, H]`` (teacher forcing: the true previous tokens); rnn runs over the slots in order."""
        emb = self.embed(prev_ids)
        if self.kind != "rnn":
            u, _ = self.step(emb.flatten(0, 1), hidden.flatten(0, 1), None)
            return u.view(emb.shape[0], emb.shape[1], -1), emb
        state, outs = None, []
        for k in range(prev_ids.shape[1]):
            u, state = self.step(emb[:, k], hidden[:, k], state)
            outs.append(u)
        return torch.stack(outs, dim=1), emb

    def bias(self, u: torch.Tensor) -> torch.Tensor:
        """``markov_w2(u)``: the logit bias over the draft vocabulary."""
        return self.markov_w2(u)

    def flops(self, rows: torch.Tensor, hidden: int, vocab: int) -> torch.Tensor:
        """Matmul FLOPs of ``rows`` slots, forward + backward (``markov_w2`` counted by the loss)."""
        r = self.rank
        per = {"vanilla": 0, "gated": 2 * (hidden + r) * r, "rnn": 2 * (2 * r + hidden) * 3 * r}[self.kind]
        return rows * (3 * per)


class ConfidenceHead(nn.Module):
    """``proj``: ``Linear(H (+ r), 1)`` with a bias, one acceptance logit per slot."""

    def __init__(self, features: int, with_markov: bool):
        super().__init__()
        self.with_markov = with_markov
        self.proj = nn.Linear(features, 1)

    def forward(self, hidden: torch.Tensor, emb: torch.Tensor | None) -> torch.Tensor:
        """Logits ``[...]`` from slot states ``[..., H]`` (and ``W1[prev]`` ``[..., r]``)."""
        x = torch.cat([hidden, emb.to(hidden.dtype)], dim=-1) if self.with_markov else hidden
        return self.proj(x).squeeze(-1)
