"""The reference implementation (speculators 0.9.0) for the differential tests: import, build, batch.

``scripts/install.sh`` installs it (``--no-deps`` plus what its model code imports); a test
module skips only when it cannot be imported at all.
"""

from __future__ import annotations

import pytest
import torch

from spectrain.data.batch import Batch


def import_peer(module: str):
    """``speculators.<module>``, or skip the calling test module with the reason."""
    return pytest.importorskip(
        f"speculators.{module}",
        reason="speculators 0.9.0 (the reference implementation) is not importable; scripts/install.sh installs it",
    )


def fp64_heads(verifier_dir):
    """The tiny verifier's frozen heads in float64 (differential tests run both models in fp64)."""
    from spectrain.models.verifier import VerifierHeads

    torch.set_num_threads(1)
    return VerifierHeads.load(verifier_dir, dtype=torch.float64)


def layer_config(verifier_dir, kind: str, num_layers: int, sliding_window: int | None = None):
    """A ``transformer_layer_config`` for the peer's draft, shaped like the tiny verifier."""
    from transformers import AutoConfig, LlamaConfig, Qwen3Config

    vc = AutoConfig.from_pretrained(verifier_dir)
    common = dict(
        vocab_size=vc.vocab_size, hidden_size=vc.hidden_size, intermediate_size=vc.intermediate_size,
        num_attention_heads=vc.num_attention_heads, num_key_value_heads=vc.num_key_value_heads,
        head_dim=vc.head_dim, max_position_embeddings=vc.max_position_embeddings, rms_norm_eps=vc.rms_norm_eps,
        tie_word_embeddings=False, hidden_act="silu", num_hidden_layers=num_layers,
        rope_parameters=dict(vc.rope_parameters),
    )  # fmt: skip
    if kind == "llama":
        return LlamaConfig(**common)
    if sliding_window is None:
        return Qwen3Config(layer_types=["full_attention"] * num_layers, **common)
    return Qwen3Config(layer_types=["sliding_attention"] * num_layers, sliding_window=sliding_window,
                       use_sliding_window=True, **common)  # fmt: skip


def packed_batch(
    doc_lens: list[int], prompt_lens: list[int], pad: int, n_aux: int, hidden: int, vocab: int, seed: int = 0
) -> Batch:
    """A packed sequence of random documents (``prompt_lens[i]`` untrained tokens first), fp64 states."""
    g = torch.Generator().manual_seed(seed)
    S = sum(doc_lens) + pad
    ids = torch.randint(0, vocab - 1, (S,), generator=g)
    mask = torch.zeros(S, dtype=torch.bool)
    pos = torch.zeros(S, dtype=torch.int64)
    doc = torch.full((S,), -1, dtype=torch.int64)
    ends = torch.arange(1, S + 1)
    start = 0
    for d, (n, p) in enumerate(zip(doc_lens, prompt_lens, strict=True)):
        mask[start + p : start + n] = True
        pos[start : start + n] = torch.arange(n)
        doc[start : start + n] = d
        ends[start : start + n] = start + n
        start += n
    states = torch.randn(S, n_aux + 1, hidden, generator=g, dtype=torch.float64)
    states[start:] = 0
    ids[start:] = 0
    return Batch(ids, mask, pos, doc, ends, states)


def perturb_norms(module: torch.nn.Module, seed: int = 1) -> None:
    """Give every norm weight a random value, so that a norm applied twice or not at all shows."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            if p.ndim == 1:
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=g, dtype=p.dtype))


def copy_into_peer(ours: torch.nn.Module, peer: torch.nn.Module) -> list[str]:
    """Copy every weight of ours into the peer's module of the same name; returns the names."""
    peer_state = peer.state_dict()
    ours_state = {k: v for k, v in ours.state_dict().items() if k not in ("d2t", "t2d")}
    missing = sorted(set(ours_state) - set(peer_state))
    assert not missing, f"weights with no counterpart in the peer: {missing}"
    peer.load_state_dict(ours_state, strict=False)
    return sorted(ours_state)


def assert_same_tensor(ours: torch.Tensor, theirs: torch.Tensor, what: str, rel: float = 1e-5) -> None:
    """Equal to within ``rel`` of the larger magnitude. Both sides run RMSNorms and rotary tables
    in fp32 inside an fp64 model, so agreement stops at fp32 rounding (~1e-7 here)."""
    assert ours.shape == theirs.shape, (what, ours.shape, theirs.shape)
    scale = theirs.abs().max().clamp_min(1e-12)
    err = float((ours - theirs).detach().abs().max() / scale.detach())
    assert err <= rel, f"{what}: max difference {err:.2e} of the largest magnitude (allowed {rel:.0e})"
