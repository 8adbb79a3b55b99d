"""Tiny synthetic drafts and packed sequences for tests of the training step (no store, no files)."""

from __future__ import annotations

import torch

from spectrain.data.batch import Batch
from spectrain.models import build_draft, get_config_class
from spectrain.models.verifier import VerifierHeads, VerifierInfo

V, H, S = 256, 32, 128
OPTIONS = {"dflash": {"num_layers": 2, "block_size": 4, "max_anchors": 16},
           "dspark": {"num_layers": 2, "block_size": 4, "max_anchors": 16, "markov_rank": 8, "markov_head_type": "rnn",
                      "loss_mix": {"ce": 0.1, "tv": 1.8}},
           "eagle3": {"draft_vocab_size": 96, "ttt_steps": 3}}  # fmt: skip


def verifier_info(vocab: int = V, hidden: int = H, *, attention_heads: int = 4, kv_heads: int = 2,
                  head_dim: int = 8, intermediate: int = 64, max_positions: int = 512) -> VerifierInfo:  # fmt: skip
    """The config of a tiny four-layer Qwen3-shaped verifier."""
    return VerifierInfo(path="t", name_or_path="t", architectures=("Qwen3ForCausalLM",), model_type="qwen3",
                        hidden_size=hidden, vocab_size=vocab, num_hidden_layers=4,
                        num_attention_heads=attention_heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                        intermediate_size=intermediate, rms_norm_eps=1e-6, rope_theta=1e4,
                        max_position_embeddings=max_positions, tie_word_embeddings=False)  # fmt: skip


def random_heads(info: VerifierInfo, generator: torch.Generator, dtype: torch.dtype = torch.float32,
                 device: str = "cpu") -> VerifierHeads:  # fmt: skip
    """Random frozen heads of ``info``: embeddings, then the LM head, drawn from ``generator``; norm weights 1."""
    V, H = info.vocab_size, info.hidden_size
    emb, head = torch.randn(V, H, generator=generator), torch.randn(V, H, generator=generator)
    return VerifierHeads(
        info, emb.to(device, dtype), torch.ones(H, device=device, dtype=dtype), head.to(device, dtype)
    )


def heads(dtype: torch.dtype = torch.float32, device: str = "cpu", seed: int = 0) -> VerifierHeads:
    """Random frozen verifier heads (embeddings, norm, LM head) of a tiny Qwen3-shaped verifier."""
    return random_heads(verifier_info(), torch.Generator().manual_seed(seed), dtype, device)


def draft(algorithm: str, verifier: VerifierHeads | None = None, seed: int = 0, **options):
    """A tiny draft of ``algorithm`` (its vocabulary map built from uniform counts)."""
    verifier = verifier or heads()
    torch.manual_seed(seed)
    cfg = get_config_class(algorithm)(aux_layer_ids=(1, 2, 3), **{**OPTIONS[algorithm], **options})
    model = build_draft(cfg, verifier).to(verifier.lm_head.device)
    if model.needs_token_counts:
        model.prepare(torch.arange(V, dtype=torch.float64))
    return model


def packed(
    seed: int = 1, dtype: torch.dtype = torch.bfloat16, device: str = "cpu", lengths=(50, 41, 30)
) -> Batch:
    """One packed sequence of ``S`` slots: documents of ``lengths`` (loss on their last two thirds), padding after."""
    g = torch.Generator().manual_seed(seed)
    used = sum(lengths)
    pos = torch.cat([torch.arange(n) for n in lengths] + [torch.zeros(S - used, dtype=torch.long)])
    doc = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)] + [torch.full((S - used,), -1)])
    ends = torch.cat([torch.full((n,), sum(lengths[: i + 1])) for i, n in enumerate(lengths)]
                     + [torch.arange(used, S) + 1])  # fmt: skip
    size = torch.cat([torch.full((n,), n) for n in lengths] + [torch.ones(S - used, dtype=torch.long)])
    loss = (pos >= size // 3) & (doc >= 0)
    ids = torch.randint(0, V, (S,), generator=g)
    hs = torch.randn(S, 4, H, generator=g).to(dtype)
    return Batch(ids, loss, pos, doc, ends, hs, sample_ids=[f"s{seed}"], num_tokens=used).to(device)
